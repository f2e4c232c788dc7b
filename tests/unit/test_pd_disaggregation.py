"""Prefill/decode disaggregation (docs/disaggregation.md) on a tiny random-weight model in memory: the instances
run in this process (LocalExecutors) with their own KV caches and exchange blocks through the shared staging
area, as the worker processes do. Greedy answers equal the colocated engine's; every transfer's blocks arrive
intact; aborts at each stage of a request's life leave no block or staging slot behind."""
import random

import pytest
import torch

from fake_pipeline import TINY
from tdpipe.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tdpipe.core.engine import LLMEngine
from tdpipe.sampling.params import SamplingParams

BS = 4


def config(pd: bool, num_blocks: int = 64, prefill: int = 1, decode: int = 1, caching: bool = False,
           slots: int | None = None, budget: int = 32, kv: str = "auto") -> EngineConfig:
    par = (ParallelConfig(disaggregation="pd", prefill_workers=prefill, decode_workers=decode,
                          kv_transfer_blocks=slots) if pd else ParallelConfig())
    return EngineConfig(dtype="float32", num_threads=torch.get_num_threads(),
                        cache=CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=caching,
                                          kv_cache_dtype=kv),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                                  max_model_len=num_blocks * BS),
                        parallel=par)


def prompts(n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY["vocab_size"]) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def run(engine: LLMEngine, ps: list[list[int]], max_tokens: int = 6) -> dict[str, list[int]]:
    out = {str(i): [] for i in range(len(ps))}
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id] += d.new_token_ids
    return out


def check_clean(engine: LLMEngine) -> None:
    for bm in engine.scheduler.block_managers():
        bm.check_no_leaks()
    engine.scheduler.slots.check_no_leaks()
    assert not engine.scheduler.has_unfinished() and not engine._inflight


@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2)])
def test_greedy_tokens_equal_the_colocated_engine(layout):
    ps = prompts(10)
    ref_engine = LLMEngine.from_config(config(False), hf_config=TINY, seed=1)
    ref = run(ref_engine, ps)
    ref_engine.shutdown()
    engine = LLMEngine.from_config(config(True, prefill=layout[0], decode=layout[1]), hf_config=TINY, seed=1)
    got = run(engine, ps)
    assert got == ref
    assert len(engine.scheduler.transfers) == len(ps)  # every request went prefill -> decode
    check_clean(engine)
    engine.shutdown()


def test_int8_kv_cache_travels_with_its_scales():
    """--kv-cache-dtype int8: the staging area holds the instances' int8 rows (values and scales), so the
    disaggregated engine answers what the colocated int8 engine answers."""
    ps = prompts(6, seed=8)
    ref_engine = LLMEngine.from_config(config(False, kv="int8"), hf_config=TINY, seed=1)
    ref = run(ref_engine, ps)
    ref_engine.shutdown()
    engine = LLMEngine.from_config(config(True, kv="int8"), hf_config=TINY, seed=1)
    assert run(engine, ps) == ref
    t = engine.scheduler.transfers[0]
    src = engine.executor.instance_rpc(t["from"], "kv_blocks", (t["prefill_blocks"],))[0]
    dst = engine.executor.instance_rpc(t["to"], "kv_blocks", (t["decode_blocks"],))[0]
    assert src.dtype == torch.int8 and src.shape[-1] == TINY["hidden_size"] // TINY["num_attention_heads"] + 4
    full = t["tokens"] // BS  # the full blocks: the decode side writes behind the prompt in the last one
    assert src.abs().sum() > 0 and torch.equal(src[:, :, :full], dst[:, :, :full])
    check_clean(engine)
    engine.shutdown()


def test_kv_transfer_block_by_block():
    """The decode instance's blocks hold exactly what the prefill instance computed, block by block (the last,
    partial block up to the prompt's end: the decode writes behind it)."""
    engine = LLMEngine.from_config(config(True), hf_config=TINY, seed=1)
    run(engine, [list(range(1, 19))], max_tokens=1 + 1)  # 18 tokens: 4 full blocks and 2 of a fifth
    (t,) = engine.scheduler.transfers
    assert t["tokens"] == 18 and len(t["prefill_blocks"]) == len(t["decode_blocks"]) == 5
    src = engine.executor.instance_rpc(t["from"], "kv_blocks", (t["prefill_blocks"],))[0]
    dst = engine.executor.instance_rpc(t["to"], "kv_blocks", (t["decode_blocks"],))[0]
    assert src.abs().sum() > 0
    for j in range(5):
        n = BS if j < 4 else 18 - 4 * BS
        assert torch.equal(src[:, :, j, :, :n], dst[:, :, j, :, :n]), f"block {j} differs"
    engine.shutdown()


def test_prefix_cache_works_on_the_prefill_side():
    engine = LLMEngine.from_config(config(True, caching=True), hf_config=TINY, seed=1)
    shared = list(range(1, 17))
    first = run(engine, [shared + [20, 21]])
    bm = engine.scheduler.prefill[0].bm
    hits = bm.prefix_cache_hits
    second = run(engine, [shared + [20, 21]])
    assert bm.prefix_cache_hits - hits == 16 and first == second
    check_clean(engine)
    engine.shutdown()


def _free_counts(engine: LLMEngine) -> list[int]:
    return [bm.num_free_blocks for bm in engine.scheduler.block_managers()] + [engine.scheduler.slots.num_free]


def test_aborts_at_every_stage_leave_nothing_behind():
    engine = LLMEngine.from_config(config(True), hf_config=TINY, seed=1)
    start = _free_counts(engine)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    sched = engine.scheduler
    # mid-prefill: submitted to the prefill instance, not yet returned
    engine.add_request("a", list(range(1, 12)), params)
    engine.step()  # the prefill of "a" returns: it waits in staging (arrived) for the decode side
    engine.add_request("b", list(range(1, 9)), params)
    # mid-transfer: "a" arrived with its KV in staging, not yet imported
    assert [s.request_id for s in sched.arrived] == ["a"]
    engine.abort_request("a")
    assert not sched.arrived and "a" not in {s.request_id for s in sched.running}
    # mid-prefill: "b" is in the prefill micro-batch in flight once step() submits it
    engine.add_request("c", list(range(3, 10)), params)
    for _ in range(3):
        engine.step()
        if any(s.request_id == "c" for side in sched.decode for s in side.running):
            break
    engine.abort_request("b")  # wherever it is now
    # mid-decode: "c" decodes on the decode instance
    for _ in range(3):
        engine.step()
    assert any(s.request_id == "c" for side in sched.decode for s in side.running)
    engine.abort_request("c")
    while engine._inflight:
        engine.step()
    assert _free_counts(engine) == start
    check_clean(engine)
    engine.shutdown()


def test_abort_in_flight_on_each_side():
    """A request aborted while its prefill step is in flight, and one aborted while the decode step that
    imports its KV is in flight: their blocks and slots come back when the steps return."""
    engine = LLMEngine.from_config(config(True), hf_config=TINY, seed=1)
    start = _free_counts(engine)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("p", list(range(1, 10)), params)
    batch = engine.scheduler.schedule()  # the prefill of "p", submitted by hand so it stays in flight
    engine._submit(batch)
    engine.abort_request("p")
    assert engine.step() == []  # its result is dropped
    engine.add_request("d", list(range(1, 10)), params)
    engine.step()  # prefilled; arrived
    batch = engine.scheduler.schedule()  # the decode step importing "d"'s KV
    assert batch.kv_import and batch.instance == 1
    engine._submit(batch)
    engine.abort_request("d")
    engine.step()
    assert _free_counts(engine) == start
    check_clean(engine)
    engine.shutdown()


def test_small_decode_side_preempts_back_to_prefill():
    """A decode instance too small for every request preempts by recompute: the request prefills again (on the
    prefill instance) and still gets the colocated engine's tokens."""
    ps = prompts(6, seed=2)
    ref_engine = LLMEngine.from_config(config(False, num_blocks=64), hf_config=TINY, seed=1)
    ref = run(ref_engine, ps, max_tokens=12)
    ref_engine.shutdown()
    engine = LLMEngine.from_config(config(True, num_blocks=24), hf_config=TINY, seed=1)
    got = run(engine, ps, max_tokens=12)
    assert got == ref and engine.scheduler.num_preemptions > 0
    check_clean(engine)
    engine.shutdown()


def test_refused_combinations_name_the_field():
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        ParallelConfig(disaggregation="pd", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(disaggregation="pd", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="prefill_workers"):
        ParallelConfig(prefill_workers=2)
    with pytest.raises(ValueError, match="scheduler"):
        EngineConfig(scheduler=SchedulerConfig(policy="throttle"), parallel=ParallelConfig(disaggregation="pd"))
    engine = LLMEngine.from_config(config(True), hf_config=TINY, seed=1)
    with pytest.raises(ValueError, match="n / best_of"):
        engine.add_request("n", [1, 2, 3], SamplingParams(n=2, max_tokens=2))
    assert not engine.requests
    engine.shutdown()


def test_trace_and_weight_update_cover_every_instance():
    """--trace records every instance's steps (each event names its instance); an update_weights reaches every
    instance and empties every page table's prefix cache."""
    from tdpipe.core.engine_builder import random_weights
    from tdpipe.core.weight_sync import update_weights

    cfg = config(True, caching=True)
    cfg.collect_trace = True
    engine = LLMEngine.from_config(cfg, hf_config=TINY, seed=1)
    before = run(engine, prompts(3))
    trace = engine.trace()
    assert {e["instance"] for e in trace["stages"][0]["events"]} == {0, 1}
    assert all("done" in e for e in trace["engine"])
    assert engine.scheduler.prefill[0].bm.num_cached_blocks > 0
    update_weights(engine, random_weights(TINY, 2))
    assert all(bm.num_cached_blocks == 0 for bm in engine.scheduler.block_managers())
    after = run(engine, prompts(3))
    engine.shutdown()
    ref_engine = LLMEngine.from_config(config(False), hf_config=TINY, seed=2)
    assert after == run(ref_engine, prompts(3)) != before  # the new weights, on both sides
    ref_engine.shutdown()
