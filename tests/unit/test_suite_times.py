"""`pytest --suite-times FILE` (tests/conftest.py) and its summary (scripts/suite_times.py): where the suite's
time goes, per test and per file."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # starts a Python process that imports torch
def test_suite_times_writes_a_line_per_test_and_the_script_sums_them(tmp_path):
    out = tmp_path / "times.jsonl"
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--suite-times", str(out),
                        "tests/unit/test_cli.py::test_version",
                        "tests/unit/test_cli.py::test_the_version_is_read_when_asked_not_at_import"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [row["id"].split("::")[1] for row in rows] == ["test_version",
                                                         "test_the_version_is_read_when_asked_not_at_import"]
    assert all(set(row) == {"id", "wall", "cpu", "children_cpu"} and row["wall"] >= 0 for row in rows)
    assert rows[0]["children_cpu"] < 0.5 < rows[1]["children_cpu"]  # the second starts a Python process
    s = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "suite_times.py"), str(out)],
                       capture_output=True, text=True, timeout=60)
    assert s.returncode == 0, s.stderr
    assert "tests/unit/test_cli.py" in s.stdout and "all 2 tests" in s.stdout and "1 tests starting processes" in s.stdout
