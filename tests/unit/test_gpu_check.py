"""tdpipe gpu-check without a GPU: the dry run of every step at tiny sizes on the CPU (step order, JSON, the
parity and roofline arithmetic), the parity judgement, and the one-line refusal where there is no CUDA."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tdpipe.bench import gpu_check as gc
from tdpipe.bench.parity import TIE_ABS, compare, first_divergence, near_tie, top2_margin
from tdpipe.bench.roofline import decode_step_bytes, decode_weight_bytes, roofline
from tdpipe.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # loads a (tiny) model and starts pytest
def test_dry_run_runs_every_step_in_order_and_writes_one_json(tmp_path, monkeypatch, capsys):
    from tdpipe.cli import main

    monkeypatch.setattr(gc, "MODELS_ROOT", tmp_path / "models")  # the tiny random model is drawn here
    out = tmp_path / "check.json"
    code = main(["gpu-check", "run", "--dry-run", "--in-process", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert code == (0 if doc["passed"] else 1)
    assert doc["schema"] == gc.SCHEMA and doc["device"] == "cpu" and doc["mode"].startswith("dry run")
    assert list(doc["steps"]) == ["environment", "parity", "tests", "throughput_bundled", "throughput_8b"]
    env = doc["environment"]
    assert env["torch"] and env["matmul_bf16_tflops"] > 0 and env["copy_bytes_per_s"] > 0 and env["gpu"] is None
    for name in ("environment", "tests", "throughput_bundled", "throughput_8b"):
        assert doc["steps"][name]["status"] == "passed", doc["steps"][name]
    assert doc["steps"]["tests"]["exit_code"] == 5  # tests/gpu: nothing collected without CUDA, by design
    cases = {(c["dtype"], c["pp"]): c for c in doc["steps"]["parity"]["cases"]}
    assert set(cases) == {("float32", 1), ("bfloat16", 1)} and cases[("float32", 1)]["passed"]
    for row in cases[("bfloat16", 1)]["rows"]:  # a bf16 divergence, if any, carries its evidence
        assert row["identical"] or {"top2_margin", "fp32_gap", "near_tie"} <= set(row)
    big = doc["steps"]["throughput_8b"]
    eng = big["engine"]
    assert eng["output_tokens"] == eng["expected_output_tokens"] == gc.TINY.num_prompts * gc.TINY.output_len
    assert big["ratio_vs_transformers"] == pytest.approx(
        eng["output_tokens_per_s"] / big["transformers"]["hf_output_tokens_per_s"])
    roof = big["roofline"]["measured_copy"]  # a CPU has no datasheet row: the measured copy bandwidth
    assert big["roofline"]["gpu_spec"] is None and roof["batch"] == gc.TINY.num_prompts
    t = doc["targets"]
    assert t["decode_roofline_fraction_8b"]["value"] == roof["fraction"]
    assert t["decode_roofline_fraction_8b"]["met"] == (roof["fraction"] >= 0.5)
    assert t["throughput_vs_transformers_bundled"] == {"target": 10, "value": doc["steps"]["throughput_bundled"][
        "ratio_vs_transformers"], "met": doc["steps"]["throughput_bundled"]["ratio_vs_transformers"] >= 10}
    points = eng["decode_points"]  # the roofline is the arithmetic of the recorded steps
    mc = ModelConfig.from_hf(eng["model_config"])
    fractions = [decode_step_bytes(mc, d, c) / s / env["copy_bytes_per_s"] for d, c, s in points]
    assert roof["fraction"] == pytest.approx(statistics.median(fractions)) and roof["steps"] == len(points)
    assert "target decode_roofline_fraction_8b" in capsys.readouterr().out
    split = eng["steps"]  # the timed run's time: its steps' own (decode ones as the points say) and the rest
    assert split["decode_s"] >= sum(s for _, _, s in points) - 1e-9 and split["prefill_s"] > 0
    assert split["longest_step_s"] <= split["decode_s"] + split["prefill_s"]
    assert split["prefill_s"] + split["decode_s"] + split["outside_steps_s"] == pytest.approx(eng["elapsed_s"])


def test_parity_judgement_exact_and_near_ties():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1 and first_divergence([1, 2], [1, 2, 3]) == 2
    assert top2_margin([0.0, 3.0, 2.5]) == pytest.approx(0.5)
    assert near_tie([0.0, 10.0, 10.05], 2, 1) == (pytest.approx(0.05), True)
    assert near_tie([0.0, 10.0, 12.0], 2, 1)[1] is False
    prompts, ref, eng = [[7, 8]], [[1, 2, 4]], [[1, 2, 3]]
    tie = {(7, 8, 1, 2): [0.0, 0.0, 0.0, 5.0, 5.0 + TIE_ABS / 2]}  # fp32: tokens 3 and 4 nearly tie
    res = compare(prompts, eng, ref, exact=False, ref_logits=lambda ids: [0.0, 0.0, 0.0, 1.0, 1.25],
                  tie_logits=lambda ids: tie[tuple(ids)])
    row = res["rows"][0]
    assert res["passed"] and row["position"] == 2 and row["engine_token"] == 3 and row["reference_token"] == 4
    assert row["top2_margin"] == pytest.approx(0.25) and row["near_tie"]
    assert not compare(prompts, eng, ref, exact=True)["passed"]  # float32: identical or nothing
    far = compare(prompts, eng, ref, exact=False, tie_logits=lambda ids: [0, 0, 0, 1.0, 9.0])
    assert not far["passed"] and far["rows"][0]["fp32_gap"] == pytest.approx(8.0)


def test_decode_roofline_arithmetic_on_the_8b_config():
    mc = ModelConfig.from_hf(gc.model_config("llama-3-8b"))
    weights = decode_weight_bytes(mc)
    assert weights == pytest.approx(2 * (8.03e9 - 128256 * 4096), rel=0.01)  # all but the embedding gather
    kv = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16: 128 KiB a token
    assert decode_step_bytes(mc, 256, 256 * 200) == weights + 256 * 200 * kv + 256 * kv
    step = {"decode_seqs": 256, "context_tokens": 256 * 200, "start": 1.0, "end": 1.010}
    r = roofline(mc, [step, step | {"decode_seqs": 8}], 3.35e12)
    assert r["batch"] == 256 and r["steps"] == 1
    assert r["fraction"] == pytest.approx(decode_step_bytes(mc, 256, 256 * 200) / 0.010 / 3.35e12)
    with pytest.raises(ValueError, match="no decode steps"):
        roofline(mc, [], 1e12)


def test_no_cuda_is_one_line_and_exit_2(capsys, monkeypatch):
    from tdpipe.cli import main

    monkeypatch.delenv("TDPIPE_GPU_CHECK_DEVICE", raising=False)
    assert main(["gpu-check", "run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu-check: no CUDA device") and "\n" not in err
    with pytest.raises(SystemExit):
        main(["gpu-check", "run", "--steps"])  # argparse: the flag needs its value
    capsys.readouterr()
    assert main(["gpu-check", "run", "--dry-run", "--in-process", "--steps", "warp"]) == 2
    assert "unknown step(s) ['warp']" in capsys.readouterr().err


@pytest.mark.slow  # starts bash and Python
def test_the_script_refuses_a_machine_without_cuda_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TDPIPE_GPU_CHECK_DEVICE"} | {"PYTHON": sys.executable}
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "x.json")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().startswith("gpu_check.sh: no CUDA device")
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()


@pytest.mark.slow  # starts one Python process
def test_a_step_runs_in_a_process_of_its_own_within_the_budget(tmp_path):
    runner = gc.Runner(gc.TINY, "cpu", isolate=True, budget_s=100, log_dir=tmp_path / "logs")
    env = runner.run("environment")
    assert env["status"] == "passed" and env["device"] == "cpu" and env["matmul_n"] == gc.TINY.gemm_n
    assert env["seconds"] > 0 and (tmp_path / "logs" / "environment.log").is_file()
    spent = gc.Runner(gc.TINY, "cpu", isolate=True, budget_s=5, log_dir=None).run("parity")
    assert spent["status"] == "not run" and "budget" in spent["error"]


def test_pipeline_depth_reaches_the_throughput_engines(tmp_path, monkeypatch):
    """--pipeline-depth 2: the throughput steps' engines keep two micro-batches in flight (pp = 1), and the
    JSON says which depth each ran at."""
    from tdpipe.cli import main

    monkeypatch.setattr(gc, "MODELS_ROOT", tmp_path / "models")
    seen = []
    real = gc.job_engine
    monkeypatch.setitem(gc.JOBS, "engine", lambda *a, **kw: seen.append(kw.get("depth")) or real(*a, **kw))
    out = tmp_path / "check.json"
    main(["gpu-check", "run", "--dry-run", "--in-process", "--steps", "throughput_bundled", "--pipeline-depth", "2",
          "--json", str(out)])
    doc = json.loads(out.read_text())
    assert seen == [2] and doc["pipeline_depth"] == 2
    eng = doc["steps"]["throughput_bundled"]["engine"]
    assert eng["pipeline_depth"] == 2 and eng["output_tokens"] == eng["expected_output_tokens"]
