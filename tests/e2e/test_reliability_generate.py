"""An interrupted call leaves a working engine, an aborted request gives its blocks back, errors stay per
request, a shut-down engine lets go of its memory: on the bundled model, or on a tiny random one where the
point is the engine's behaviour. The result sink and the checks before loading are unit tests
(tests/unit/test_result_sink.py)."""
import _thread
import gc
import json
import threading
import weakref

import pytest

from tdpipe import SamplingParams
from tdpipe.cli import main

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def ctrl_c_during_generate(llm, n: int, max_tokens: int, after_steps: int = 3) -> None:
    """A SIGINT (what Ctrl-C and Jupyter's interrupt send) from another thread once generate() has run
    `after_steps` engine steps, so that it lands mid-call on any machine; the call must end in
    KeyboardInterrupt. The generation is short: should the signal go astray, the test fails fast."""
    eng, steps, sender = llm.engine, [0], threading.Thread(target=_thread.interrupt_main)
    real = eng.step

    def step():
        steps[0] += 1
        if steps[0] == after_steps:
            sender.start()
        return real()

    eng.step = step
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Tell me a story"] * n, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
    finally:
        del eng.step
    assert steps[0] >= after_steps
    sender.join()


def lines(path) -> list[dict]:
    return [json.loads(x) for x in open(path).read().splitlines()]


# -- the bundled model -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm_tiny(qwen2_tiny):
    """One engine on the tiny random model for the tests that interrupt and abort calls on it."""
    from tdpipe import LLM

    with LLM(model=qwen2_tiny[0], dtype="float32", kv_cache_memory=64 << 20) as llm:
        yield llm


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
def test_keyboard_interrupt_in_generate_then_next_call_works(llm_tiny):
    """Ctrl-C (SIGINT, as Jupyter's interrupt sends) lands at a step boundary; the call's requests are
    aborted, every block comes back, and the next call gives the same tokens as before."""
    ref = llm_tiny.generate(PROMPTS, greedy(), use_tqdm=False)
    ctrl_c_during_generate(llm_tiny, 24, 64)
    eng = llm_tiny.engine
    assert not eng.has_unfinished() and not eng.requests
    eng.block_manager.check_no_leaks()
    again = llm_tiny.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]
    eng.block_manager.check_no_leaks()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["collect", "schedule", "sample"])
def test_interrupt_anywhere_inside_a_step_recovers(llm_tiny, monkeypatch, where):
    """A KeyboardInterrupt raised inside the step itself (a second Ctrl-C, or a signal handler of the user's),
    not at its boundary: still no block held and the next call right."""
    eng = llm_tiny.engine
    ref = llm_tiny.generate(PROMPTS, greedy(), use_tqdm=False)
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
        llm_tiny.generate(["Tell me a story"] * 24, sp, use_tqdm=False)
    monkeypatch.setattr(*target, real)
    eng.block_manager.check_no_leaks()
    again = llm_tiny.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.slow
def test_abort_request_frees_blocks_and_the_rest_finish(llm_tiny):
    eng = llm_tiny.engine
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
def test_shutdown_releases_and_every_call_raises(qwen2_tiny):
    from tdpipe import LLM

    gc.disable()  # the weights and the KV cache must go without the cycle collector
    try:
        llm = LLM(model=qwen2_tiny[0], dtype="float32", kv_cache_memory=32 << 20)
        runner = weakref.ref(llm.engine.executor.runner)
        assert llm.generate("Hi", greedy(2), use_tqdm=False)[0].outputs[0].token_ids
        del llm
        assert runner() is None, "del llm left the model (and its KV cache) alive"
        llm = LLM(model=qwen2_tiny[0], dtype="float32", kv_cache_memory=32 << 20)
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
def test_interrupt_recovers_under_every_policy(qwen2_tiny, policy):
    from tdpipe import LLM

    # 48 blocks of 16 tokens for 24 x (4 + 64): some requests wait or are preempted when the interrupt lands
    with LLM(model=qwen2_tiny[0], dtype="float32", num_kv_blocks=48, max_model_len=512, scheduler=policy,
             predictor="constant:40") as llm:
        ref = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        ctrl_c_during_generate(llm, 24, 64)
        llm.engine.block_manager.check_no_leaks()
        if policy == "td-pipe":
            assert not any(llm.engine.scheduler.kv_usage)  # no predicted KV of aborted requests left
        again = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.slow
def test_keyboard_interrupt_at_pp2_then_next_call_works(qwen2_tiny, monkeypatch):
    """pp = 2: micro-batches are in flight when the interrupt lands; they are drained and dropped, and the
    stages' block tables stay in step with the engine's for the next call."""
    from tdpipe import LLM

    with LLM(model=qwen2_tiny[0], dtype="float32", pipeline_parallel_size=2, layer_partition=[2, 1],
             num_kv_blocks=48, max_model_len=512) as llm:
        ref = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        ctrl_c_during_generate(llm, 16, 64)
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
