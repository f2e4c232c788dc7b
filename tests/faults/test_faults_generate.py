"""Fault injection on `tdpipe generate -o` (run alone with `pytest -m faults`): SIGKILL and SIGINT of the engine
process and SIGKILL of a stage, during start-up and at a random point of the run, at pp = 1 and 2.

After every fault: each answer on disk is one whole JSON line, no prompt twice; the run is over within 20 s;
no stage process is left; a SIGINT exits 130 with one line and no traceback; and `--resume` answers exactly
the prompts that are missing. The random points come from a seed printed on failure.

On the tiny random Qwen2 (`qwen2_tiny`): the point is the processes and the output file, not the answers,
and it starts in a fraction of the bundled model's time (these runs were 270 s of a one-core worker on it).
Two prompts at a time, 48 tokens each, keep a run going long enough to be hit mid-run."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from procs import alive, stage_pids_of

pytestmark = pytest.mark.faults

N = 12
DEADLINE = 20.0


def _cmd(out, inp, pp: int, model: str, resume: bool = False, seeded: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "tdpipe.cli", "generate", "-i", str(inp), "-o", str(out), "--model", model,
           "--max-tokens", "48", "--ignore-eos", "--max-num-seqs", "2", "--max-model-len", "512",
           "--kv-cache-memory", "16MiB", "--no-progress"]
    if seeded:  # no prefix caching: a cached prefix's KV was computed in another batch shape (ulps apart),
        # which can move a temperature-0.8 draw; the run and its resumption must compute the same numbers
        cmd += ["--dtype", "float32", "--sampling-seed", "7", "--temperature", "0.8", "--no-enable-prefix-caching"]
    if pp > 1:
        cmd += ["--pp", str(pp), "--layer-partition", "2,1", "--lm-head-split", "0"]  # nothing to measure
    return cmd + (["--resume"] if resume else [])


def _records(out) -> list[dict]:
    if not os.path.exists(out):
        return []
    text = open(out).read()
    assert text == "" or text.endswith("\n"), "a cut line on disk"
    recs = [json.loads(x) for x in text.splitlines()]  # every line valid JSON
    idx = [r["index"] for r in recs]
    assert len(idx) == len(set(idx)), f"a prompt answered twice: {idx}"
    return recs


def _wait_for(cond, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def prompts(tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("".join(f"Write a short story number {i} about a lighthouse.\n" for i in range(N)))
    return inp


CASES = [(pp, victim, sig, when) for pp in (1, 2)
         for victim, sig in [("engine", signal.SIGKILL), ("engine", signal.SIGINT)] + ([("stage", signal.SIGKILL)]
                                                                                       if pp > 1 else [])
         for when in ("startup", "running")]


@pytest.mark.parametrize("pp,victim,sig,when", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_fault_keeps_finished_answers(tmp_path, prompts, qwen2_tiny_path, pp, victim, sig, when):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    out = tmp_path / "out.jsonl"
    # PYTHONFAULTHANDLER: a hang below shows every thread's stack
    p = subprocess.Popen(_cmd(out, prompts, pp, qwen2_tiny_path), start_new_session=True,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    try:
        if when == "startup":
            if victim == "stage":  # while it loads its layers and joins the groups
                assert _wait_for(lambda: len(stage_pids_of(p.pid)) == pp, 60), "stages never started"
                time.sleep(rng.uniform(0.0, 0.3))
            else:  # after the interpreter starts (its own first ms are not ours), while it imports and builds
                time.sleep(rng.uniform(0.2, 1.5))
        else:
            k = rng.randint(1, 6)
            assert _wait_for(lambda: len(_records(out)) >= k or p.poll() is not None, 240), f"seed {seed}"
        if p.poll() is not None:
            pytest.fail(f"the run ended before the fault (rc {p.returncode}), seed {seed}: {p.stderr.read()}")
        stages = stage_pids_of(p.pid)
        if victim == "engine":
            os.killpg(p.pid, sig) if sig == signal.SIGINT else p.send_signal(sig)  # Ctrl-C hits the group
        else:
            os.kill(rng.choice(stages), sig)
        t = time.time()
        try:
            err = p.communicate(timeout=DEADLINE)[1]
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)  # faulthandler prints where each thread stands
            pytest.fail(f"still running {DEADLINE} s after the fault (seed {seed}):\n{p.communicate(timeout=30)[1]}")
        took = time.time() - t
        assert _wait_for(lambda: not any(os.path.exists(f"/proc/{s}") and alive(s) for s in stages), DEADLINE), \
            f"stage processes left behind (seed {seed})"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    recs = _records(out)
    assert took < DEADLINE
    if victim == "engine" and sig == signal.SIGINT:
        assert p.returncode == 130, err
        assert "Traceback" not in err, err
        assert len(err.strip().splitlines()) <= 3, err
        assert f"{len(recs)} of {N} prompts answered" in err or when == "startup", err
    elif victim == "stage":
        assert p.returncode == 1, err
        assert "Traceback" not in err and "stage" in err and f"{len(recs)} of {N} prompts answered" in err, err
    # --resume finishes exactly the rest
    r = subprocess.run(_cmd(out, prompts, pp, qwen2_tiny_path, resume=True), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert sorted(x["index"] for x in _records(out)) == list(range(N))


def test_resumed_answers_equal_an_uninterrupted_run(tmp_path, prompts, qwen2_tiny_path):
    """Seeded sampling: the answers a resumed run adds are the ones one uninterrupted run gives."""
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    subprocess.run(_cmd(whole, prompts, 1, qwen2_tiny_path, seeded=True), check=True, capture_output=True,
                   timeout=600)
    ref = {r["index"]: r["text"] for r in _records(whole)}
    keep = [json.dumps(r) for r in _records(whole)][: 2 * N // 3]
    cut.write_text("\n".join(keep) + "\n" + keep[-1][:10])  # a run killed mid-line
    r = subprocess.run(_cmd(cut, prompts, 1, qwen2_tiny_path, resume=True, seeded=True), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "unfinished last line" in r.stderr
    assert {x["index"]: x["text"] for x in _records(cut)} == ref


def test_sigint_to_a_stage_alone_is_ignored(tmp_path, prompts, qwen2_tiny_path):
    """Stages leave SIGINT to the engine (a terminal's Ctrl-C reaches the engine's process group, which the
    stages are not in): a SIGINT sent to one stage alone changes nothing, and the run completes."""
    out = tmp_path / "out.jsonl"
    p = subprocess.Popen(_cmd(out, prompts, 2, qwen2_tiny_path), start_new_session=True,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: len(_records(out)) >= 1 or p.poll() is not None, 240)
        for s in stage_pids_of(p.pid):
            os.kill(s, signal.SIGINT)
        err = p.communicate(timeout=300)[1]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0 and "Traceback" not in err, err
    assert sorted(r["index"] for r in _records(out)) == list(range(N))
