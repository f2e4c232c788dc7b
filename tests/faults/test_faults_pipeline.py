"""Faults at pp > 1: nothing hangs, Ctrl-C is clean, nothing listens beyond the loopback.

A stage SIGKILLed at any moment of the start-up (as soon as it exists, half a second in, while it builds
its gloo groups) or mid-run fails the engine within seconds with a PipelineError naming it, and leaves no
stage process. A SIGKILLed engine takes its stages along. A Ctrl-C (SIGINT to the whole process group of
`tdpipe generate --pp 2`) ends the run in one line, no traceback. A KeyboardInterrupt while collect() waits
arrives within a second, and after drain() the pipeline computes the right tokens again. The rendezvous
store and the gloo groups listen on 127.0.0.1 only. A stage that cannot start gives one clear error.

All on a random 3-layer Qwen2 (starts in seconds); run with `-m faults`.
"""
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import hf_greedy
from procs import alive, broken_model_copy, stage_pids_of

from tdpipe import LLM, SamplingParams
from tdpipe.pipeline.executor import PipelineError
from tdpipe.pipeline.processes import StageProcesses
from tdpipe.step_input import StepInput

pytestmark = pytest.mark.faults


# --------------------------------------------------------------------------------------------- helpers


def make_llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="float32", kv_cache_memory=16 << 20, pipeline_parallel_size=2,
               layer_partition=[2, 1], **kw)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def wait_gone(pids, within: float) -> list[int]:
    """The pids still alive after `within` seconds (empty: all gone)."""
    deadline = time.time() + within
    left = [p for p in pids if alive(p)]
    while left and time.time() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


@pytest.fixture
def no_stage_left():
    """After the test: no stage process of this test process is alive."""
    before = set(stage_pids_of(os.getpid()))
    yield
    left = wait_gone(set(stage_pids_of(os.getpid())) - before, 5.0)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"stage processes left behind: {left}"


def hang_guard(seconds: float):
    """Should the engine hang anyway, kill its stages after `seconds`, so the test fails instead."""
    def kill():
        for pid in stage_pids_of(os.getpid()):
            os.kill(pid, signal.SIGKILL)
    t = threading.Timer(seconds, kill)
    t.daemon = True
    t.start()
    return t


# --------------------------------------------------------------------------------------------- start-up


def _key_of(rank: int, group: str) -> str:
    return f"tdpipe/{group}/0/{rank}"  # a rank's gloo address in that group's rendezvous


@pytest.mark.parametrize("victim, when", [(0, "spawned"), (1, "spawned"), (0, "0.5s"), (1, "0.5s"),
                                          (1, "ctrl-group"), (0, "data-group")])
def test_stage_killed_during_startup(qwen2_tiny, monkeypatch, no_stage_left, victim, when):
    """Killed before it joins, while a spawned interpreter imports, or after it published its address in the
    first or last group's rendezvous (the engine is then inside the gloo group constructor): the constructor
    fails with the stage named, within seconds, never the 10-minute rendezvous timeout."""
    spawn = StageProcesses.spawn
    killed: list[float] = []

    def kill(pid: int) -> None:
        killed.append(time.time())
        os.kill(pid, signal.SIGKILL)

    def spawn_and_kill(self, port):
        spawn(self, port)
        pid = self.procs[victim].pid
        if when == "spawned":
            kill(pid)
        elif when == "0.5s":
            threading.Timer(0.5, kill, (pid,)).start()
        else:
            key = _key_of(victim + 1, when.split("-")[0])

            def watch() -> None:
                deadline = time.time() + 60
                while time.time() < deadline and self.procs[victim].poll() is None:
                    if self.rendezvous.store.check([key]):
                        return kill(pid)
                    time.sleep(0.001)
            threading.Thread(target=watch, daemon=True).start()

    monkeypatch.setattr(StageProcesses, "spawn", spawn_and_kill)
    if when == "0.5s":
        # "while it imports": only a spawned interpreter has that phase (>1 s of torch import); a stage
        # forked by the zygote has imported already and may have joined within 0.5 s
        monkeypatch.setenv("TDPIPE_PREFORK", "0")
    guard = hang_guard(40)
    t0 = time.time()
    try:
        with pytest.raises(PipelineError) as e:
            make_llm(qwen2_tiny[0])
    finally:
        guard.cancel()
    assert killed, "the start-up finished before the stage was killed"
    took = time.time() - killed[0]
    print(f"stage {victim} killed ({when}): PipelineError {took:.2f} s later")
    assert took < 20, f"noticed {took:.1f} s after the kill"
    msg = str(e.value)
    assert f"stage {victim}" in msg and "signal 9" in msg, msg
    assert time.time() - t0 < 60


def test_ctrl_c_right_after_a_stage_started_stops_that_stage_too(qwen2_tiny, monkeypatch, no_stage_left):
    """A Ctrl-C between a stage's start and the engine's record of it (a terminal's Ctrl-C as the stages
    come up): the start-up ends in a KeyboardInterrupt and that stage is stopped with the others, instead of
    being left in the rendezvous, unknown to the engine."""
    from tdpipe.pipeline import processes

    fork = processes.zygote.fork

    def fork_then_interrupt(argv, env):
        proc = fork(argv, env)
        os.kill(os.getpid(), signal.SIGINT)  # Python raises it at the next instruction, before the return
        return proc

    monkeypatch.setattr(processes.zygote, "fork", fork_then_interrupt)
    guard = hang_guard(40)
    try:
        with pytest.raises(KeyboardInterrupt):
            make_llm(qwen2_tiny[0])
    finally:
        guard.cancel()


# --------------------------------------------------------------------------------------------- mid-run


def test_stage_killed_mid_run(qwen2_tiny, no_stage_left):
    llm = make_llm(qwen2_tiny[0])
    try:
        ex = llm.engine.executor
        pid = ex.stage_pids[0]
        killed: list[float] = []
        timer = threading.Timer(0.5, lambda: (killed.append(time.time()), os.kill(pid, signal.SIGKILL)))
        guard = hang_guard(30)
        timer.start()
        try:
            with pytest.raises(PipelineError) as e:
                llm.generate([[5 + i] * 8 for i in range(16)], greedy(400), use_tqdm=False)
        finally:
            timer.cancel()
            guard.cancel()
        assert killed, "generate() ended before the stage was killed"
        assert time.time() - killed[0] < 10
        assert "stage 0" in str(e.value) and str(pid) in str(e.value) and "signal 9" in str(e.value)
        t0 = time.time()
        with pytest.raises(PipelineError):  # stays failed, at once
            llm.generate([[7, 8, 9]], greedy(2), use_tqdm=False)
        assert time.time() - t0 < 2
    finally:
        llm.shutdown()


def test_stage_exception_reason_reaches_the_engine(qwen2_tiny, monkeypatch, no_stage_left, capfd):
    """A stage that raises mid-run: the engine's error carries the stage's own reason (written into the
    store), and the stage prints it once at most, with no traceback."""
    llm = make_llm(qwen2_tiny[0])
    try:
        ex = llm.engine.executor
        # a block id far outside the cache: the stage's KV write fails
        step = StepInput(10 ** 6, [1, 2, 3], [3], [3], [[10 ** 6]], True, greedy_rows=[True],
                         seq_ids=[10 ** 6], kv_epochs=[0])
        t0 = time.time()
        with pytest.raises(PipelineError) as e:
            ex.submit(step)
            ex.collect()
        assert time.time() - t0 < 10
        msg = str(e.value)
        assert "stage 0" in msg and "exited with code 1" in msg and ") failed: " in msg, msg
    finally:
        llm.shutdown()
    err = capfd.readouterr().err
    assert "Traceback" not in err, err


# --------------------------------------------------------------------------------------------- engine death

ENGINE_SCRIPT = """
import sys, time
from tdpipe import LLM
llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_memory=16 << 20, pipeline_parallel_size=2,
          layer_partition=[2, 1])
print("READY", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("when", ["running", "starting"])
def test_killed_engine_takes_its_stages_along(qwen2_tiny, tmp_path, when):
    """SIGKILL of the engine, after the start-up or while its stages are still starting: the stages exit
    on their own within seconds (they wait on the engine's pidfd)."""
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    eng = subprocess.Popen([sys.executable, str(script), qwen2_tiny[0]], stdout=subprocess.PIPE, text=True)
    try:
        if when == "running":
            assert eng.stdout.readline().strip() == "READY"
            pids = stage_pids_of(eng.pid)
        else:
            deadline = time.time() + 60
            pids = []
            while len(pids) < 2 and time.time() < deadline and eng.poll() is None:
                pids = stage_pids_of(eng.pid)
                time.sleep(0.01)
        assert len(pids) == 2, pids
        eng.kill()
        eng.wait(timeout=10)
        left = wait_gone(pids, 10)
        assert not left, f"stages {left} outlived the engine"
    finally:
        if eng.poll() is None:
            eng.kill()
        for pid in stage_pids_of(eng.pid):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------- Ctrl-C


@pytest.mark.parametrize("when", ["running", "starting"])
def test_ctrl_c_ends_the_cli_quietly(qwen2_tiny, tmp_path, when):
    """SIGINT to the whole foreground process group, as a terminal's Ctrl-C sends it: the engine handles
    it, the stages (own process groups) are stopped, stderr has a line or two and no traceback."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"story {i} once upon a time\n" for i in range(64)))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "tdpipe.cli", "generate", "--model", qwen2_tiny[0], "--pp", "2",
           "--layer-partition", "2,1", "--dtype", "float32", "--kv-cache-memory", "16MiB",
           "--max-tokens", "32", "--max-num-seqs", "2", "--ignore-eos", "--no-progress",
           "-i", str(prompts), "-o", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TDPIPE_DEBUG", None)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.time() + 90
        if when == "running":  # the first answers are out: generation is under way (2 at a time)
            while time.time() < deadline and p.poll() is None and not (out.exists() and out.stat().st_size):
                time.sleep(0.05)
        else:
            while time.time() < deadline and p.poll() is None and len(stage_pids_of(p.pid)) < 2:
                time.sleep(0.01)
        assert p.poll() is None, p.communicate()
        stages = stage_pids_of(p.pid)
        assert len(stages) == 2
        os.killpg(p.pid, signal.SIGINT)
        t0 = time.time()
        _, err = p.communicate(timeout=20)
        assert time.time() - t0 < 20
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip() and "max_model_len lowered" not in ln]
    assert len(lines) <= 3, err
    assert p.returncode == 130, (p.returncode, err)
    assert not wait_gone(stages, 5), "stages left running"


def _step(batch_id: int, seq_id: int, tokens: list[int], context: int, block: int) -> StepInput:
    """A one-sequence greedy step writing KV into `block`: a prefill of `tokens`, or a decode after
    `context` tokens."""
    return StepInput(batch_id, tokens, [len(tokens)], [context + len(tokens)], [[block]], context == 0,
                     greedy_rows=[True], seq_ids=[seq_id], kv_epochs=[0])


def test_keyboard_interrupt_in_collect_then_drain(qwen2_tiny, no_stage_left):
    """collect() waits on a stopped stage; a KeyboardInterrupt (a SIGALRM handler raising it) comes out
    within a second; after drain() a prefill and a decode give transformers' tokens. A second interrupt
    inside drain() gives up: the stages are stopped and later calls raise."""
    prompt = [11, 12, 13, 14, 15]
    ref = hf_greedy(qwen2_tiny[1], prompt, 2)
    llm = make_llm(qwen2_tiny[0])
    ex = llm.engine.executor
    last = ex.procs[-1].pid
    fired: list[float] = []

    def interrupt(signum, frame):
        fired.append(time.time())
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        os.kill(last, signal.SIGSTOP)
        ex.submit(_step(1, 100, prompt, 0, 0))
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            ex.collect()
        assert fired and time.time() - fired[0] < 1.0
        os.kill(last, signal.SIGCONT)
        assert ex.drain() == 1
        ex.release([100])
        # the pipeline is whole: a fresh sequence, prefill then decode, matches transformers
        ex.submit(_step(2, 101, prompt, 0, 1))
        t1 = ex.collect().token_ids
        ex.submit(_step(3, 101, t1, len(prompt), 1))
        assert t1 + ex.collect().token_ids == ref
        ex.release([101])
        # and the engine on top of it too
        assert llm.generate([prompt], greedy(2), use_tqdm=False)[0].outputs[0].token_ids == ref
        # Ctrl-C twice: out of collect(), then out of drain(): the pipeline is given up
        os.kill(last, signal.SIGSTOP)
        ex.submit(_step(4, 102, prompt, 0, 2))
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            ex.collect()
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            ex.drain()
        with pytest.raises(PipelineError, match="the pipeline was shut down"):
            ex.submit(_step(5, 103, prompt, 0, 3))
        assert not wait_gone([p.pid for p in ex.procs], 5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        for p in ex.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        llm.shutdown()


# --------------------------------------------------------------------------------------------- loopback


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on, from /proc/net/tcp{,6} and its fds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, size in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                # /proc prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
                out.append((str(ipaddress.ip_address(words)), int(hexport, 16)))
    return out


def test_engine_from_a_thread_listens_on_loopback_only(qwen2_tiny, no_stage_left):
    """Every socket the engine and its stages listen on (rendezvous store, gloo groups) is bound to
    127.0.0.1. The engine is built in a thread that then ends: the stages belong to the engine process,
    not to that thread (PR_SET_PDEATHSIG would have killed them when it ended), and still compute."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("llm", make_llm(qwen2_tiny[0])))
    t.start()
    t.join()
    llm = box["llm"]
    try:
        ex = llm.engine.executor
        engine_socks = _listening(os.getpid())
        store_port = int(ex.processes.rendezvous.store.port)
        assert ("127.0.0.1", store_port) in engine_socks, engine_socks  # the rendezvous store
        for pid in [os.getpid()] + ex.stage_pids:
            socks = _listening(pid)
            if pid != os.getpid():
                assert socks, "a stage listens for its gloo peers"
            assert all(addr == "127.0.0.1" for addr, _ in socks), (pid, socks)
        if shutil.which("ss"):  # ss agrees where it exists
            ss = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True).stdout
            mine = [ln for ln in ss.splitlines() if f"pid={os.getpid()}," in ln or
                    any(f"pid={pid}," in ln for pid in ex.stage_pids)]
            assert mine and all(ln.split()[3].startswith("127.0.0.1:") for ln in mine), ss
        assert all(p.poll() is None for p in ex.procs)
        out = llm.generate([[3, 4, 5]], greedy(4), use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(qwen2_tiny[1], [3, 4, 5], 4)
    finally:
        llm.shutdown()


# --------------------------------------------------------------------------------------------- bad start


def test_stage_that_cannot_start_gives_one_error(qwen2_tiny, tmp_path, monkeypatch, capfd, no_stage_left):
    """Stage 1 cannot load its layers: the CLI prints the engine's one line with the stage's reason, no
    traceback, and the reason once; with TDPIPE_DEBUG=1 the stage adds its traceback."""
    broken = broken_model_copy(qwen2_tiny[0], tmp_path / "broken")
    cmd = [sys.executable, "-m", "tdpipe.cli", "generate", "--model", broken, "--pp", "2",
           "--layer-partition", "2,1", "--dtype", "float32", "--kv-cache-memory", "16MiB",
           "--max-tokens", "4", "--no-progress", "-o", str(tmp_path / "out.jsonl"), "hello"]
    env = dict(os.environ)
    env.pop("TDPIPE_DEBUG", None)
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert time.time() - t0 < 60
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert "stage 1 failed to start" in r.stderr and "missing tensors" in r.stderr, r.stderr
    assert r.stderr.count("missing tensors") == 1, r.stderr  # said once, by the engine
    monkeypatch.setenv("TDPIPE_DEBUG", "1")  # the spawned stages inherit it
    capfd.readouterr()
    with pytest.raises(PipelineError, match=r"stage 1 failed to start.*missing tensors"):
        make_llm(broken)
    err = capfd.readouterr().err
    assert "Traceback" in err and "missing tensors" in err, err
