"""Prefill/decode disaggregation on the bundled model (float32), each instance its own worker process: greedy
tokens equal the colocated engine's, the transferred KV blocks equal the prefill worker's, prefix caching hits
on the prefill side, and aborts mid-prefill, mid-transfer and mid-decode leave every page table and the
staging area as they started (docs/disaggregation.md)."""
import os

import pytest
import torch

from tdpipe import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.cores(2)]  # each process pinned to a core of its own

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "What is 17 * 3?",
           "Name three primary colours and say why they are primary, in one sentence each.",
           "Once upon a time"]


def _greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def pd_llm(bundled_path):
    llm = LLM(dtype="float32", num_kv_blocks=128, disaggregation="pd", enable_prefix_caching=True)
    yield llm
    llm.shutdown()


def _free(llm) -> list[int]:
    sched = llm.engine.scheduler
    return [bm.num_free_blocks for bm in sched.block_managers()] + [sched.slots.num_free]


def test_workers_are_processes_on_their_own_cores(pd_llm):
    ex = pd_llm.engine.executor
    pids = [p for inst in ex.instances for p in inst.stage_pids]
    assert len(pids) == 2 and os.getpid() not in pids
    cores = [os.sched_getaffinity(p) for p in pids]
    if len(os.sched_getaffinity(0)) >= 2:
        assert not cores[0] & cores[1]


def test_greedy_tokens_equal_the_colocated_engine(pd_llm, llm_fp32):
    ref = [o.outputs[0].token_ids for o in llm_fp32.generate(PROMPTS, _greedy(), use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in pd_llm.generate(PROMPTS, _greedy(), use_tqdm=False)]
    assert got == ref


def test_kv_transfer_block_by_block(pd_llm):
    engine = pd_llm.engine
    prompt = "Count the blocks: one two three four five six seven eight nine ten eleven twelve."
    pd_llm.generate([prompt], _greedy(1 + 1), use_tqdm=False)
    t = engine.scheduler.transfers[-1]
    n, bs = t["tokens"], engine.config.cache.block_size
    src = engine.executor.instance_rpc(t["from"], "kv_blocks", (t["prefill_blocks"],))[0]
    dst = engine.executor.instance_rpc(t["to"], "kv_blocks", (t["decode_blocks"],))[0]
    assert len(t["decode_blocks"]) == -(-n // bs) and src.abs().sum() > 0
    for j in range(len(t["decode_blocks"])):
        k = min(bs, n - j * bs)  # the last block: the prompt's part (the decode writes behind it)
        assert torch.equal(src[:, :, j, :, :k], dst[:, :, j, :, :k]), f"block {j} differs"


def test_prefix_cache_hits_on_the_prefill_side(pd_llm):
    system = "You are a careful assistant. Answer briefly and exactly. " * 4
    bm = pd_llm.engine.scheduler.prefill[0].bm
    first = pd_llm.generate([system + "Who wrote Hamlet?"], _greedy(), use_tqdm=False)
    hits = bm.prefix_cache_hits
    again = pd_llm.generate([system + "Who wrote Hamlet?"], _greedy(), use_tqdm=False)
    assert bm.prefix_cache_hits > hits
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_aborts_mid_prefill_transfer_and_decode_leak_nothing(pd_llm):
    engine = pd_llm.engine
    sched = engine.scheduler
    start = _free(pd_llm)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("prefill", "Tell me a long story about a dragon and a knight.", params)
    batch = sched.schedule()  # in flight on the prefill worker
    engine._submit(batch)
    engine.abort_request("prefill")
    engine.add_request("transfer", "Explain photosynthesis.", params)
    engine.add_request("decode", "List the planets of the solar system.", params)
    while not any(s.request_id == "decode" for side in sched.decode for s in side.running):
        engine.step()
    if any(s.request_id == "transfer" for s in sched.arrived):
        engine.abort_request("transfer")  # its KV in staging, not yet imported
    for _ in range(4):
        engine.step()
    engine.abort_request(["transfer", "decode"])  # decoding (or its import step in flight)
    while engine.has_unfinished() or engine._inflight:
        engine.step()
    assert _free(pd_llm) == start
    for bm in sched.block_managers():
        bm.check_no_leaks()
    sched.slots.check_no_leaks()


def test_served_disconnect_returns_every_block():
    """A streaming client that leaves mid-decode (what the server does on a disconnect: abort the request): the
    engine core's page tables, summed over both instances (engine_stats), are whole again."""
    import asyncio

    from tdpipe.config import CacheConfig, EngineConfig, ParallelConfig
    from tdpipe.core.async_llm import AsyncLLM

    async def main():
        cfg = EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=64),
                           parallel=ParallelConfig(disaggregation="pd"))
        llm = await AsyncLLM.start(cfg)
        try:
            long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
            agen = llm.generate(PROMPTS[1], long, "gone")
            async for o in agen:
                if len(o.outputs[0].token_ids) >= 3:
                    break
            await agen.aclose()
            for _ in range(400):
                st = llm.stats()
                if st["num_running"] == st["num_waiting"] == 0 and st["num_free_blocks"] == st["num_blocks"]:
                    break
                await asyncio.sleep(0.05)
            assert st["num_free_blocks"] == st["num_blocks"] == 128, st
        finally:
            await llm.shutdown()
    asyncio.run(main())
