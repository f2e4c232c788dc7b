"""Stages forked from a blank process (tdpipe/pipeline/prefork.py): reserved only where the process is blank,
named and grouped as spawned stages are, seen through the Popen interface (poll, wait, kill, returncode), and
gone when released or when their engine dies."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from procs import alive, stage_pids_of

from tdpipe.config import ParallelConfig
from tdpipe.pipeline import prefork


def test_stages_for_counts_the_processes_an_engine_starts_here(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert prefork.stages_for(ParallelConfig()) == 0
    assert prefork.stages_for(ParallelConfig(pipeline_parallel_size=2)) == 2
    assert prefork.stages_for(ParallelConfig(pipeline_parallel_size=3, tensor_parallel_size=2)) == 6
    assert prefork.stages_for(ParallelConfig(disaggregation="pd", prefill_workers=1, decode_workers=2)) == 3
    assert prefork.stages_for(ParallelConfig(pipeline_parallel_size=2, data_parallel_size=2)) == 0


def test_a_process_with_threads_or_the_switch_off_is_not_blank(monkeypatch):
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert not prefork.blank()
        assert prefork.reserve(2) == 0
    finally:
        stop.set()
        t.join()
    monkeypatch.setenv("TDPIPE_PREFORK", "0")
    assert not prefork.blank()


SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch
    from tdpipe.pipeline import prefork
    n = prefork.reserve(3)
    s = prefork.take(["--bogus-flag"], dict(os.environ, MARK="1"))  # the stage's argparse exits 2
    rc = s.wait(timeout=60)
    k = prefork.take(["--master", "127.0.0.1:1", "--rank", "1", "--world-size", "2", "--parent", str(os.getpid())],
                     dict(os.environ))
    print(json.dumps({"reserved": n, "rc": rc, "pid": k.pid, "left": len(prefork._reserve),
                      "spare": [p for p, _ in prefork._reserve]}), flush=True)
    sys.stdin.readline()  # the test looks at the running stage, then lets go
    k.kill()
    print(json.dumps({"killed": k.wait(timeout=10)}), flush=True)
    spare = [p for p, _ in prefork._reserve]
    prefork.release()
    print(json.dumps({"released": [os.path.exists(f"/proc/{p}") for p in spare]}), flush=True)
    sys.stdin.readline()
""")


@pytest.mark.slow  # starts processes
def test_forked_stages_live_as_spawned_ones_do(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        first = json.loads(p.stdout.readline())
        assert first["reserved"] == 3 and first["rc"] == 2 and first["left"] == 1
        pid = first["pid"]
        end = time.time() + 10  # named as a spawned stage (python -m tdpipe.pipeline.stage ...) once it starts
        while time.time() < end and stage_pids_of(p.pid) != [pid]:
            time.sleep(0.02)
        assert stage_pids_of(p.pid) == [pid]
        assert os.getpgid(pid) == pid  # its own process group: the terminal's Ctrl-C is the engine's
        with open(f"/proc/{pid}/status") as f:
            ppid = int(next(ln for ln in f if ln.startswith("PPid:")).split()[1])
        assert ppid == p.pid
        os.kill(pid, signal.SIGINT)  # ignored, as by a spawned stage
        time.sleep(0.3)
        assert alive(pid)
        p.stdin.write("\n")
        p.stdin.flush()
        assert json.loads(p.stdout.readline()) == {"killed": -signal.SIGKILL}
        assert json.loads(p.stdout.readline()) == {"released": [False]}  # exited and reaped
        spare_before = first["spare"]
        assert spare_before and not any(alive(s) for s in spare_before)
    finally:
        p.kill()
        p.wait()


@pytest.mark.slow  # starts processes
def test_blank_stages_exit_with_their_engine():
    code = "import torch, sys\nfrom tdpipe.pipeline import prefork\nprefork.reserve(2)\n" \
           "print(' '.join(str(q) for q, _ in prefork._reserve), flush=True)\nsys.stdin.readline()\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    kids = [int(x) for x in p.stdout.readline().split()]
    assert len(kids) == 2 and all(alive(k) for k in kids)
    p.kill()  # SIGKILL: no release(); the pipes' end of file ends them
    p.wait()
    end = time.time() + 10
    while time.time() < end and any(alive(k) for k in kids):
        time.sleep(0.05)
    assert not any(alive(k) for k in kids)


ZYGOTE_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    import torch
    torch.ones(256, 256) @ torch.ones(256, 256)  # OpenMP has run and a thread is up: not blank
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    from tdpipe.pipeline import prefork, zygote
    assert not prefork.blank() and prefork.reserve(2) == 0
    bad = zygote.fork(["--bogus-flag"], dict(os.environ))
    rc = bad.wait(timeout=120)
    run = [zygote.fork(["--master", "127.0.0.1:1", "--rank", str(r), "--world-size", "3", "--parent",
                        str(os.getpid())], dict(os.environ)) for r in (1, 2)]
    run[0].kill()
    print(json.dumps({"rc": rc, "killed": run[0].wait(timeout=10), "poll": run[1].poll(), "pid": run[1].pid,
                      "zygote": zygote._zygote.proc.pid}), flush=True)
    sys.stdin.readline()
""")


@pytest.mark.slow  # starts processes
def test_a_process_that_is_not_blank_forks_its_stages_from_one_zygote():
    """Exit codes come back through the zygote; a stage still running when its engine is SIGKILLed exits,
    and so does the zygote."""
    p = subprocess.Popen([sys.executable, "-c", ZYGOTE_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        got = json.loads(p.stdout.readline())
        assert got["rc"] == 2 and got["killed"] == -signal.SIGKILL and got["poll"] is None
        stage, zyg = got["pid"], got["zygote"]
        end = time.time() + 10
        while time.time() < end and stage_pids_of(p.pid) != [stage]:
            time.sleep(0.02)
        assert stage_pids_of(p.pid) == [stage]  # named with the engine's pid, as a spawned stage
        assert os.getpgid(stage) == stage and os.getpgid(zyg) == zyg  # the engine's Ctrl-C is its own
    finally:
        p.kill()
        p.wait()
    end = time.time() + 10
    while time.time() < end and (alive(stage) or alive(zyg)):
        time.sleep(0.05)
    assert not alive(stage) and not alive(zyg)


IDLE_SCRIPT = textwrap.dedent("""
    import json, os, threading, time
    import torch
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # not blank: stages need the zygote
    from tdpipe.pipeline import zygote
    zygote.IDLE_EXIT_S = 1.0
    codes = [zygote.fork(["--bogus-flag"], dict(os.environ)).wait(timeout=120)]
    first = zygote._zygote.proc
    first.wait(timeout=30)  # no stage of its own alive: it leaves after a second
    codes.append(zygote.fork(["--bogus-flag"], dict(os.environ)).wait(timeout=120))
    print(json.dumps({"codes": codes, "first_rc": first.returncode, "first": first.pid,
                      "second": zygote._zygote.proc.pid}), flush=True)
""")


@pytest.mark.slow  # starts processes
def test_an_idle_zygote_exits_and_the_next_engine_starts_another():
    """A program that built a pipeline once does not keep the zygote (an interpreter with torch) for the rest
    of its life; a later fork starts a new one and works as the first did."""
    out = subprocess.run([sys.executable, "-c", IDLE_SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["codes"] == [2, 2]  # argparse's exit code, reported through each zygote
    assert got["first_rc"] == 0 and got["second"] != got["first"]
