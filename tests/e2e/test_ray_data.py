"""tdpipe.ray on a local Ray cluster: a Ray Data job over 200 prompts answers each exactly once, with two
CPU-only replicas of the tiny random Qwen2 (the point is the Ray plumbing, not the answers). The cluster
runs inside a network namespace whose only interface is the loopback (Ray 2.60's GCS and raylets listen on
every interface they have), so nothing outside the machine can reach it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

JOB = r'''
import json, subprocess, sys
import ray
from tdpipe.ray import ProcessorConfig, build_llm_processor

ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, _node_ip_address="127.0.0.1",
         log_to_driver=False, configure_logging=False)
config = ProcessorConfig(model=sys.argv[2], engine_kwargs={"dtype": "auto", "kv_cache_memory": 64 << 20},
                         concurrency=2, batch_size=100, num_cpus_per_replica=1)
processor = build_llm_processor(
    config,
    preprocess=lambda row: {"id": row["id"], "prompt": f"Question {row['id']}:",
                            "sampling_params": {"max_tokens": 2, "temperature": 0, "ignore_eos": True}},
    postprocess=lambda row: {"id": row["id"], "answer": row["generated_text"], "n": row["num_generated_tokens"],
                             "finish": row["finish_reason"], "error": row["error"]})
rows = processor(ray.data.from_items([{"id": i} for i in range(200)])).take_all()
interfaces = [ln.split()[0] for ln in subprocess.run(["ip", "-brief", "link"], capture_output=True,
                                                     text=True).stdout.splitlines()]
listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout.splitlines()
ray.shutdown()
json.dump({"rows": rows, "interfaces": interfaces, "listening": listening}, open(sys.argv[1], "w"))
'''


def test_ray_data_job_answers_200_prompts_exactly_once(tmp_path, qwen2_tiny):
    pytest.importorskip("ray.data", reason="the test extra installs ray[data]; tdpipe itself never needs it")
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.fail("this test needs util-linux's unshare and iproute2's ip (a loopback-only network namespace)")
    job, out = tmp_path / "job.py", tmp_path / "out.json"
    job.write_text(JOB)
    cmd = ["unshare", "--net", "--map-root-user", "sh", "-c",
           f'ip link set lo up && exec "{sys.executable}" "{job}" "{out}" "{qwen2_tiny[0]}"']
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(out.read_text())
    ids = [r["id"] for r in got["rows"]]
    assert sorted(ids) == list(range(200))  # every prompt answered, none twice
    assert all(r["n"] == 2 and r["finish"] == "length" and not r["error"] for r in got["rows"])
    assert got["interfaces"] == ["lo"]  # the cluster could listen on nothing but the loopback
    assert got["listening"], "the Ray cluster listened on no port?"
