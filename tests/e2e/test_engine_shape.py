"""The engine core's shape for serving: per-request deltas, the scheduler's update_from_output, the output
processor (text and stop strings out of the core), bounded opt-in traces."""
import random

import pytest

from tdpipe.config import SchedulerConfig
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.delta import RequestDelta
from tdpipe.core.output_processor import OutputProcessor
from tdpipe.core.scheduler import make_scheduler
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence


# -- update_from_output (no model) ----------------------------------------------------------------------------
def _sched(policy="hybrid", budget=8):
    cfg = SchedulerConfig(policy=policy, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64)
    bm = BlockManager(64, 4)
    sched = make_scheduler(cfg, bm, eos_token_ids={2})
    return sched, bm


def _seq(i, prompt, **sp):
    p = SamplingParams(**sp)
    return Sequence(i, str(i), [5] * prompt, p, max_tokens=p.max_tokens or 32)


def test_update_from_output_chunks_sample_nothing_until_the_prompt_is_done():
    sched, bm = _sched(budget=8)
    s = _seq(0, 20, max_tokens=3)
    sched.add(s)
    b = sched.schedule()
    assert b.num_new_tokens == [8] and b.sampled_rows() == []
    assert sched.update_from_output(b, []) == [] and s.num_computed_tokens == 8 and not s.output_token_ids
    with pytest.raises(ValueError, match="1 tokens for 0 sampled rows"):
        sched.update_from_output(sched.schedule(), [9])


def test_update_from_output_stops_on_eos_stop_ids_and_length_and_frees_blocks():
    sched, bm = _sched(budget=64)
    a, b, c, d = (_seq(0, 4, max_tokens=10), _seq(1, 4, max_tokens=10, stop_token_ids=[7]),
                  _seq(2, 4, max_tokens=2), _seq(3, 4, max_tokens=10, min_tokens=2))
    for s in (a, b, c, d):
        sched.add(s)
    batch = sched.schedule()
    assert batch.sampled_rows() == [0, 1, 2, 3]
    done = sched.update_from_output(batch, [2, 7, 9, 2])  # eos for a; stop id for b; d's eos is < min_tokens
    assert done == [a, b] and a.finish_reason == "stop" and a.stop_reason is None
    assert b.finish_reason == "stop" and b.stop_reason == 7 and not a.block_table and not b.block_table
    assert not d.is_finished and d.output_token_ids == [2]
    done = sched.update_from_output(sched.schedule(), [9, 9])
    assert done == [c] and c.finish_reason == "length" and c.output_token_ids == [9, 9]
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.update_from_output(batch, [9] * len(batch.sampled_rows()))
    assert d.finish_reason == "length" and len(d.output_token_ids) == 10
    bm.check_no_leaks()
    assert bm.num_free_blocks == bm.num_blocks


def test_update_from_output_stops_at_max_model_len():
    sched, bm = _sched(budget=64)
    s = _seq(0, 60)  # max_model_len 64: four tokens fit
    s.max_tokens = 100
    sched.add(s)
    while not s.is_finished:
        batch = sched.schedule()
        sched.update_from_output(batch, [9] * len(batch.sampled_rows()))
    assert s.finish_reason == "length" and s.num_tokens == 64


# -- output processor (the bundled tokenizer) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(bundled_path):
    from tdpipe.tokenizer import load_tokenizer

    return load_tokenizer(bundled_path)


def _feed(proc, rid, ids, finish_at=None):
    outs, stopped = [], []
    for k, t in enumerate(ids):
        fin = finish_at is not None and k == finish_at
        o, s = proc.process([RequestDelta(rid, [t], fin, "length" if fin else None)])
        outs += o
        stopped += s
        if fin or s:
            break
    return outs, stopped


def test_incremental_text_equals_one_decode_and_streams_growing_text(tok):
    text = "Héllo wörld — ünïcode 😀 and 日本語 text, with spaces   and\nnew lines."
    ids = tok.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tok, stream=True)
    prompt = tok.encode("Say:", add_special_tokens=False)
    proc.add_request("r", "Say:", prompt, SamplingParams(max_tokens=len(ids)))
    outs, _ = _feed(proc, "r", ids, finish_at=len(ids) - 1)
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "streamed text never takes anything back"
    assert all("\ufffd" not in t for t in texts), "half a character was streamed"
    assert texts[-1] == tok.decode(ids, skip_special_tokens=True) and outs[-1].finished
    assert [o.finished for o in outs].count(True) == 1 and not proc.has_unfinished()


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text_holds_back_a_partial_stop_and_asks_the_core_to_stop(tok, include):
    ids = tok.encode("one two three four five six", add_special_tokens=False)
    proc = OutputProcessor(tok, stream=True)
    proc.add_request("r", None, [1, 2], SamplingParams(stop=["four", "zzz"], include_stop_str_in_output=include))
    outs, stopped = _feed(proc, "r", ids)
    assert stopped == [("r", 0)] and outs[-1].finished
    comp = outs[-1].outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == "four"
    assert comp.text == ("one two three four" if include else "one two three ")
    if not include:  # streamed text never showed a prefix of a stop string it later had to take back
        for o in outs[:-1]:
            assert comp.text.startswith(o.outputs[0].text) and len(o.outputs[0].text) <= len(comp.text)


def test_offline_processor_returns_only_finished_and_ignores_unknown_ids(tok):
    proc = OutputProcessor(tok, stream=False)
    proc.add_request("a", None, [1], SamplingParams())
    outs, _ = proc.process([RequestDelta("a", [tok.encode("hi", add_special_tokens=False)[0]]),
                            RequestDelta("ghost", [5], True, "length")])
    assert outs == []
    outs, _ = proc.process([RequestDelta("a", [5], True, "length", num_preemptions=2)])
    assert len(outs) == 1 and outs[0].outputs[0].finish_reason == "length" and outs[0].metrics.num_preemptions == 2
    assert proc.abort("a") is None  # already finished
    proc.add_request("b", None, [1], SamplingParams())
    assert proc.abort("b").outputs[0].finish_reason == "abort"
    proc.add_request("c", None, [1], SamplingParams())
    with pytest.raises(ValueError, match="already running"):
        proc.add_request("c", None, [1], SamplingParams())


# -- the engine's step() deltas and traces (real model) ----------------------------------------------------------
def _drive(engine, n=6, max_tokens=5, seed=0):
    rng = random.Random(seed)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"r{i}", [rng.randrange(100, 1000) for _ in range(rng.randint(3, 40))], sp)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(n)}
    finished = []
    steps = 0
    while engine.has_unfinished():
        for d in engine.step():
            assert not got[d.request_id] or not finished.count(d.request_id), "a delta after finishing"
            got[d.request_id] += d.new_token_ids
            if d.finished:
                finished.append(d.request_id)
                assert d.finish_reason == "length"
        steps += 1
    return got, finished, steps


@pytest.mark.parametrize("pp", [1, 2])
def test_step_returns_a_delta_for_every_request_that_advanced(pp):
    from tdpipe import LLM

    with LLM(dtype="float32", kv_cache_memory=32 << 20, pipeline_parallel_size=pp, scheduler="hybrid",
             max_num_batched_tokens=32) as llm:
        eng = llm.engine
        got, finished, steps = _drive(eng)
        assert sorted(finished) == sorted(got) and all(len(v) == 5 for v in got.values())
        assert steps > 5  # tokens arrived over many steps, one delta each, not only at the end
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        with pytest.raises(RuntimeError, match="collect_trace"):
            eng.trace()
        assert len(eng.kv_trace) == 0 and len(eng.engine_trace) == 0  # nothing kept unless asked


def test_trace_is_bounded():
    from tdpipe.config import EngineConfig
    from tdpipe.core.engine import LLMEngine

    eng = LLMEngine(EngineConfig(dtype="float32", collect_trace=True, trace_max_events=4))
    try:
        _drive(eng, n=4, max_tokens=6)
        t = eng.trace()
        assert len(t["kv"]) == 4 and len(t["engine"]) <= 4 and len(t["stages"][0]["events"]) <= 4
        assert len(eng.kv_trace) == 4
    finally:
        eng.shutdown()
