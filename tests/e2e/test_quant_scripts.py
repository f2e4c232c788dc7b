"""The perplexity scripts quantization.md quotes run as written against today's engine (each patches the
engine's quantisation step, so a changed signature there breaks them silently otherwise): a few variants on
64 tokens of the tiny random Qwen2 (its point is that they run, not the figures)."""
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, model: str, *args: str) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "quant" / script), "--max-tokens", "64",
                        "--model", model, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_ablation_script_runs_its_variants(tmp_path, qwen2_tiny_path):
    out = tmp_path / "ablation.json"
    _run("ppl_ablation.py", qwen2_tiny_path, "--only", "32 largest", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["bf16", "w8a8 unrotated, down_proj's 32 largest inputs in float"]
    assert all("error" not in r and 1 < r["perplexity"] < math.inf and r["tokens"] == 63 for r in rows), rows


def test_the_realizations_script_samples_the_rounding(tmp_path, qwen2_tiny_path):
    out = tmp_path / "realizations.json"
    _run("ppl_realizations.py", qwen2_tiny_path, "--realizations", "2", "--json", str(out))
    d = json.loads(out.read_text())
    assert [r["k"] for r in d["w8a8"]] == [0, 1]
    costs = [r["vs_bf16"] for r in d["w8a8"]]
    assert all(math.isfinite(c) for c in costs) and d["w8a8_vs_bf16"]["min"] == min(costs)
