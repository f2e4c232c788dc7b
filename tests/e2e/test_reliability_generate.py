"""Finished work survives, an interrupted call leaves a working engine, errors stay per request.

Unit tests of the result sink, the preflight checks and the conversation check need no model; the rest
use the bundled model (marked slow)."""
import _thread
import errno
import gc
import json
import os
import threading
import weakref

import pytest

from tdpipe import SamplingParams
from tdpipe.entrypoints.cli import main
from tdpipe.entrypoints.conversation import check_conversation
from tdpipe.entrypoints.preflight import PreflightError, check_readable, check_writable
from tdpipe.entrypoints.results import ResultSink

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def ctrl_c_during_generate(llm, n: int, max_tokens: int, after: float) -> None:
    """A SIGINT (what Ctrl-C and Jupyter's interrupt send) `after` seconds into a long generate() call,
    which must end in KeyboardInterrupt."""
    timer = threading.Timer(after, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Tell me a story"] * n, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    timer.join()


def lines(path) -> list[dict]:
    return [json.loads(x) for x in open(path).read().splitlines()]


# -- no model ----------------------------------------------------------------------------------------------
def test_preflight_names_the_flag(tmp_path):
    with pytest.raises(PreflightError, match=r"--json .*directory .* does not exist"):
        check_writable(str(tmp_path / "missing" / "r.json"), "--json")
    with pytest.raises(PreflightError, match="--output .*is a directory"):
        check_writable(str(tmp_path), "--output")
    with pytest.raises(PreflightError, match="--input .*no such file"):
        check_readable(str(tmp_path / "nope.txt"), "--input")
    check_writable(str(tmp_path / "new.jsonl"), "-o")
    assert not (tmp_path / "new.jsonl").exists()  # checking creates nothing


def test_sink_writes_each_line_at_once_and_orders_on_request(tmp_path):
    out = tmp_path / "o.jsonl"
    with ResultSink(str(out), ordered=True) as s:
        s.write(2, {"index": 2})
        assert not out.exists() or out.read_text() == ""  # held back: 0 and 1 are not done
        s.write(0, {"index": 0})
        assert [r["index"] for r in lines(out)] == [0]  # on disk before the call ends
        s.write(1, {"index": 1})
        assert [r["index"] for r in lines(out)] == [0, 1, 2]
        assert s.finish(3) == 0


def test_sink_stopped_writes_what_it_held_back(tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    with ResultSink(str(out), ordered=True) as s:
        s.write(3, {"index": 3})
        s.write(1, {"index": 1})
        assert s.stopped(5, "interrupted", 130) == 130
    assert sorted(r["index"] for r in lines(out)) == [1, 3]
    err = capsys.readouterr().err
    assert "interrupted: 2 of 5 prompts answered" in err and "--resume" in err


def test_sink_resume_drops_a_cut_line_and_checks_the_input(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps({"index": 1, "prompt": "b"}) + "\n" + '{"index": 0, "pro')
    s = ResultSink(str(out), resume=True)
    assert s.done == {1}
    assert out.read_text().count("\n") == 1 and out.read_text().endswith("\n")
    s.check_resumed([{"prompt": "a"}, {"prompt": "b"}])
    with pytest.raises(PreflightError, match="different input"):
        s.check_resumed([{"prompt": "a"}, {"prompt": "changed"}])
    with pytest.raises(PreflightError, match="different input"):
        s.check_resumed([{"prompt": "a"}])
    with s:
        s.write(0, {"index": 0, "prompt": "a"})
    assert [r["index"] for r in lines(out)] == [1, 0]


def test_sink_failed_write_leaves_whole_lines(tmp_path, monkeypatch):
    out = tmp_path / "o.jsonl"
    sink = ResultSink(str(out))
    sink.write(0, {"index": 0, "text": "x" * 100})
    real = os.write

    def half_then_full(fd, data):  # the disk fills in the middle of a line
        real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError):
        sink.write(1, {"index": 1, "text": "y" * 100})
    monkeypatch.setattr(os, "write", real)
    assert sink.write_failed
    assert [r["index"] for r in lines(out)] == [0]


def test_conversation_check_names_the_message():
    check_conversation([{"role": "user", "content": "hi"}])
    for bad, msg in [([], "non-empty"), ("hi", "non-empty list"), ([{"role": "user"}], "message 0: missing 'content'"),
                     ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
                      "message 1: unknown role 'robot'"),
                     ([{"role": "user", "content": 3}], "'content' must be a string")]:
        with pytest.raises(ValueError, match=msg):
            check_conversation(bad)


def test_cli_checks_outputs_before_loading(tmp_path, capsys):
    for flag in ("-o", "--trace", "--record-history"):
        rc = main(["generate", "hi", flag, str(tmp_path / "no" / "f.json")])
        assert rc == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "does not exist" in err
    assert main(["generate", "hi", "--resume"]) == 2
    assert "--resume needs --output" in capsys.readouterr().err
    assert main(["generate", "-i", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err


# -- the bundled model -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_jsonl_errors_are_per_line(tmp_path, bundled_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([json.dumps({"prompt": "The capital of France is"}), json.dumps({"prompt": 5}),
                              "{not json", json.dumps({"messages": [{"role": "bot", "content": "x"}]}),
                              json.dumps({"prompt_token_ids": [1, "a"]}), json.dumps([1, 2]),
                              json.dumps({"messages": [{"role": "user", "content": "Hi"}]})]) + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "-i", str(inp), "-o", str(out), "--max-tokens", "3", "--dtype", "float32",
               "--kv-cache-memory", "64MiB", "--no-progress"])
    assert rc == 1  # some requests failed
    recs = {r["index"]: r for r in lines(out)}
    assert sorted(recs) == list(range(7))
    for i, msg in [(1, "line 2: 'prompt' must be a string"), (2, "line 3: not valid JSON"),
                   (3, "line 4: 'messages': message 0: unknown role 'bot'"), (4, "line 5: 'prompt_token_ids'"),
                   (5, "line 6: expected a JSON object")]:
        assert recs[i]["finish_reason"] == "error" and recs[i]["error"].startswith(msg), recs[i]
    assert recs[0]["finish_reason"] == "length" and recs[6]["finish_reason"] != "error"


@pytest.mark.slow
def test_keyboard_interrupt_in_generate_then_next_call_works(llm_fp32):
    """Ctrl-C (SIGINT, as Jupyter's interrupt sends) lands at a step boundary; the call's requests are
    aborted, every block comes back, and the next call gives the same tokens as before."""
    ref = llm_fp32.generate(PROMPTS, greedy(), use_tqdm=False)
    ctrl_c_during_generate(llm_fp32, 48, 400, after=0.5)
    eng = llm_fp32.engine
    assert not eng.has_unfinished() and not eng.requests
    eng.block_manager.check_no_leaks()
    again = llm_fp32.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]
    eng.block_manager.check_no_leaks()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["collect", "schedule", "sample"])
def test_interrupt_anywhere_inside_a_step_recovers(llm_fp32, monkeypatch, where):
    """A KeyboardInterrupt raised inside the step itself (a second Ctrl-C, or a signal handler of the user's),
    not at its boundary: still no block held and the next call right."""
    eng = llm_fp32.engine
    ref = llm_fp32.generate(PROMPTS, greedy(), use_tqdm=False)
    target = {"collect": (eng.executor, "collect"), "schedule": (eng.scheduler, "schedule"),
              "sample": (eng, "_sample")}[where]
    real = getattr(*target)
    calls = [0]

    def boom(*a, **k):
        calls[0] += 1
        if calls[0] == 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(*target, boom)
    sp = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=1)
    with pytest.raises(KeyboardInterrupt):
        llm_fp32.generate(["Tell me a story"] * 24, sp, use_tqdm=False)
    monkeypatch.setattr(*target, real)
    eng.block_manager.check_no_leaks()
    again = llm_fp32.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.slow
def test_abort_request_frees_blocks_and_the_rest_finish(llm_fp32):
    eng = llm_fp32.engine
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seqs = [eng.add_request(f"a{i}", p, sp) for i, p in enumerate(PROMPTS)]
    eng.step()
    eng.step()  # some are running now
    gone = eng.abort_request(["a1", "a3", "unknown"])
    assert [s.request_id for s in gone] == ["a1", "a3"] and all(s.finish_reason == "abort" for s in gone)
    assert not seqs[1].block_table and not seqs[3].block_table
    done = []
    while eng.has_unfinished():
        done += [d for d in eng.step() if d.finished]
    assert sorted(d.request_id for d in done) == ["a0", "a2"]
    assert len(seqs[0].output_token_ids) == len(seqs[2].output_token_ids) == 20
    eng.block_manager.check_no_leaks()


@pytest.mark.slow
def test_shutdown_releases_and_every_call_raises(bundled_path):
    from tdpipe import LLM

    gc.disable()  # the weights and the KV cache must go without the cycle collector
    try:
        llm = LLM(dtype="float32", kv_cache_memory=32 << 20)
        runner = weakref.ref(llm.engine.executor.runner)
        assert llm.generate("Hi", greedy(2), use_tqdm=False)[0].outputs[0].token_ids
        del llm
        assert runner() is None, "del llm left the model (and its KV cache) alive"
        llm = LLM(dtype="float32", kv_cache_memory=32 << 20)
        runner = weakref.ref(llm.engine.executor.runner)
        llm.shutdown()
        assert runner() is None
        llm.shutdown()  # twice is fine
        for call in (lambda: llm.generate("Hi", use_tqdm=False), lambda: llm.chat([{"role": "user", "content": "x"}]),
                     lambda: llm.engine.step()):
            with pytest.raises(RuntimeError, match="shut down"):
                call()
    finally:
        gc.enable()


@pytest.mark.slow
def test_tiny_kv_budget_is_an_error_or_a_visible_warning(bundled_path, caplog):
    from tdpipe import LLM

    with pytest.raises(ValueError, match="kv_cache_memory: 1024 bytes hold no KV block"):
        LLM(dtype="float32", kv_cache_memory=1024)
    with caplog.at_level("WARNING", logger="tdpipe"):
        llm = LLM(dtype="float32", kv_cache_memory=1 << 20)  # one block: 16 tokens
    assert "max_model_len lowered from 8192 to" in caplog.text
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["hybrid", "throttle", "td-pipe"])
def test_interrupt_recovers_under_every_policy(bundled_path, policy):
    from tdpipe import LLM

    with LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, scheduler=policy,
             predictor="constant:40") as llm:
        ref = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        ctrl_c_during_generate(llm, 48, 400, after=0.5)
        llm.engine.block_manager.check_no_leaks()
        if policy == "td-pipe":
            assert not any(llm.engine.scheduler.kv_usage)  # no predicted KV of aborted requests left
        again = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.slow
def test_keyboard_interrupt_at_pp2_then_next_call_works(bundled_path, monkeypatch):
    """pp = 2: micro-batches are in flight when the interrupt lands; they are drained and dropped, and the
    stages' block tables stay in step with the engine's for the next call."""
    from tdpipe import LLM

    with LLM(dtype="float32", pipeline_parallel_size=2, layer_partition=[15, 15], kv_cache_memory=64 << 20,
             max_model_len=512) as llm:
        ref = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        ctrl_c_during_generate(llm, 32, 300, after=1.0)
        llm.engine.block_manager.check_no_leaks()
        again = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]
        # and a KeyboardInterrupt raised inside collect() itself (not deferred to the step boundary)
        real, calls = llm.engine.executor.collect, [0]

        def boom():
            calls[0] += 1
            if calls[0] == 5:
                raise KeyboardInterrupt
            return real()

        monkeypatch.setattr(llm.engine.executor, "collect", boom)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Tell me a story"] * 16, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
        monkeypatch.setattr(llm.engine.executor, "collect", real)
        llm.engine.block_manager.check_no_leaks()
        again = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]
