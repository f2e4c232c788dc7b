"""scripts/gpu_decode_tune.py, which only a GPU session runs for real, launches the decode kernels with their
full argument list: its --quick mode (the CPU, Triton's interpreter, tiny sizes) runs every stage of it, so a
change to the kernels' signature breaks here rather than in the device time of a GPU session (it did once:
the soft cap's two new arguments)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a Python process that imports torch and interprets Triton kernels: ~10 s
def test_quick_tuning_runs_and_agrees_with_the_reference(tmp_path):
    out = tmp_path / "tune.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_decode_tune.py"), "--quick", "--shapes", "bundled",
                    str(out)], check=True, env=env, timeout=300, capture_output=True)
    doc = json.loads(out.read_text())
    stages = {r["stage"] for r in doc["rows"]}
    assert {"tile", "pipeline"} <= stages, stages
    assert all(r["max_abs_err"] < 1e-2 for r in doc["rows"] if "max_abs_err" in r)
