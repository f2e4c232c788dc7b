"""`pytest --suite-times FILE` (tests/conftest.py) and its summary (scripts/suite_times.py): where the suite's
time goes, per test and per file; and the pytest-xdist workers the suite runs on (one core each)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # starts a Python process that imports torch
def test_suite_times_writes_a_line_per_test_and_the_script_sums_them(tmp_path):
    out = tmp_path / "times.jsonl"
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider",
                        "--suite-times", str(out),
                        "tests/unit/test_cli.py::test_version",
                        "tests/unit/test_cli.py::test_the_version_is_read_when_asked_not_at_import"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    # the second is marked slow, so it runs first (tests/conftest.py: the longest tests first)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [row["id"].split("::")[1] for row in rows] == ["test_the_version_is_read_when_asked_not_at_import",
                                                         "test_version"]
    assert all(set(row) == {"id", "worker", "start", "wall", "cpu", "children_cpu", "idle"} and row["wall"] >= 0
               and row["worker"] == "main" and 0 <= row["idle"] <= row["wall"] + 0.05 for row in rows)
    assert rows[0]["start"] + rows[0]["wall"] <= rows[1]["start"] + 0.01
    assert rows[1]["children_cpu"] < 0.5 < rows[0]["children_cpu"]  # the slow one starts a Python process
    s = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "suite_times.py"), str(out)],
                       capture_output=True, text=True, timeout=60)
    assert s.returncode == 0, s.stderr
    assert "tests/unit/test_cli.py" in s.stdout and "all 2 tests" in s.stdout and "1 tests starting processes" in s.stdout
    assert "cores idle while tests ran: main" in s.stdout


@pytest.mark.parametrize("copy", [0, 1])  # two, so that a two-worker run gives each worker one
def test_an_xdist_worker_runs_on_one_core_with_one_thread(copy, request):
    """tests/conftest.py pins each pytest-xdist worker (`-n auto`, the default) to one core of its own, one
    torch thread; a run without workers keeps every core. TDPIPE_TEST_CORES_FILE: where the two-worker run
    below collects what each worker saw."""
    import torch
    from conftest import xdist_worker

    worker = xdist_worker(request.config)
    cores = sorted(os.sched_getaffinity(0))
    if worker:
        assert len(cores) == 1 and torch.get_num_threads() == 1
    if os.environ.get("TDPIPE_TEST_CORES_FILE"):
        with open(os.environ["TDPIPE_TEST_CORES_FILE"], "a") as f:
            f.write(json.dumps({"worker": worker, "cores": cores}) + "\n")


@pytest.mark.slow  # starts pytest with two workers, each importing torch
def test_two_workers_get_different_cores(tmp_path):
    seen = tmp_path / "cores.jsonl"
    probe = "tests/unit/test_suite_times.py::test_an_xdist_worker_runs_on_one_core_with_one_thread"
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", probe],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TDPIPE_TEST_CORES_FILE=str(seen)))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(x) for x in seen.read_text().splitlines()]
    assert sorted(row["worker"] for row in rows) == ["gw0", "gw1"]
    if len(os.sched_getaffinity(0)) >= 2:  # this test's own worker lends it nothing: see the cores marker
        assert rows[0]["cores"] != rows[1]["cores"]


def test_the_longest_tests_run_first():
    """Fault-injection tests, then end-to-end ones, then the unit tests; each group keeps its order."""
    from types import SimpleNamespace

    import conftest

    class Item:
        def __init__(self, name, folder, mark=None):
            self.name, self.marks = name, {mark} if mark else set()
            self.path = SimpleNamespace(parent=SimpleNamespace(name=folder))

        def add_marker(self, m):
            self.marks.add(m.name)

        def get_closest_marker(self, name):
            return name if name in self.marks else None

    items = [Item("u1", "unit"), Item("e1", "e2e"), Item("f1", "faults", "faults"), Item("u2", "unit"),
             Item("e2", "e2e"), Item("f2", "faults", "faults")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["f1", "f2", "e1", "e2", "u1", "u2"]
    assert "slow" in items[2].marks  # e2e: marked on the way


def test_test_modules_have_unique_basenames():
    """The test folders are not packages: pytest imports each module by its basename, so two of one name
    (tests/unit/test_x.py and tests/e2e/test_x.py) stop the collection with an import-file mismatch."""
    seen: dict[str, str] = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                assert f not in seen, f"{f} is in both {seen[f]} and {folder}"
                seen[f] = folder
