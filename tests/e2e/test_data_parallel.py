"""--data-parallel-size 2 on the bundled model (float32): two engine replicas, each pinned to its own core,
give LLM.generate the single engine's greedy tokens, share the work, refuse bad requests one by one, take a
weight update from a folder, and answer every line of a run-batch file exactly once."""
from __future__ import annotations

import json
import os

import pytest

from procs import alive
from tdpipe import LLM, SamplingParams
from tdpipe.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.cores(2)]  # each process pinned to a core of its own

PROMPTS = [f"Tell me fact number {i} about the sea." for i in range(10)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_two_replicas_pinned_equal_one_engine(llm_fp32, bundled_path):
    ref = [o.outputs[0].token_ids for o in llm_fp32.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(dtype="float32", data_parallel_size=2, kv_cache_memory=64 << 20) as llm:
        reps = llm.replicas.client.replicas
        pids = [r._proc.pid for r in reps]
        masks = [os.sched_getaffinity(p) for p in pids]
        assert masks[0].isdisjoint(masks[1]) and masks[0] | masks[1] <= os.sched_getaffinity(0)
        assert [r.cpus for r in reps] == [sorted(m) for m in masks]
        outs = llm.generate(PROMPTS + [""], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:-1]] == ref
        assert outs[-1].outputs[0].finish_reason == "error" and "empty" in outs[-1].error
        assert all(r.stats()["generation_tokens"] > 0 for r in reps)  # both did work
        assert llm.update_weights(bundled_path) == 1
        again = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert [o.weight_version for o in again] == [1, 1]
        assert [o.outputs[0].token_ids for o in again] == ref[:2]  # the same weights, reloaded
        with pytest.raises(ValueError, match="data_parallel_size 1"):
            llm.sleep()
    assert not any(alive(p) for p in pids)


def test_run_batch_over_two_replicas(tmp_path):
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": p, "max_tokens": 4, "temperature": 0}}) for i, p in enumerate(PROMPTS)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    engine = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--data-parallel-size", "2"]
    assert main(["run-batch", "-i", str(inp), "-o", str(out), *engine]) == 0
    first = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in first) == sorted(f"r{i}" for i in range(len(PROMPTS)))
    assert all(r["response"]["status_code"] == 200 for r in first)
    # resuming is the batch file's (the engine client does not take part): tests/unit/test_run_batch.py
