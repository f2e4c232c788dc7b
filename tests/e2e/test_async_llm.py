"""AsyncLLM: the frontend over an engine core in its own process (ZeroMQ). Real model, real processes."""
import asyncio
import dataclasses
import os
import signal

import pytest

from tdpipe.config import CacheConfig, EngineConfig, ParallelConfig
from tdpipe.core.async_llm import AsyncLLM, EngineDeadError
from tdpipe.sampling.params import SamplingParams

from procs import alive, stage_pids_of

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def cfg(pp=1):
    return EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory=64 << 20),
                        parallel=ParallelConfig(pipeline_parallel_size=pp))


async def collect(llm, prompt, sp, rid):
    outs = [o async for o in llm.generate(prompt, sp, rid)]
    return outs


async def wait_idle(llm, timeout=20.0):
    for _ in range(int(timeout / 0.05)):
        st = llm.stats()
        if st["num_running"] == st["num_waiting"] == 0 and st["num_free_blocks"] == st["num_blocks"]:
            return st
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine not idle: {llm.stats()}")


@pytest.fixture(scope="module")
def offline():
    from tdpipe import LLM

    with LLM(dtype="float32", kv_cache_memory=64 << 20) as llm:
        yield llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)


def test_output_kinds_final_only_and_delta(offline):
    """vLLM's RequestOutputKind: FINAL_ONLY yields the finished output alone; DELTA yields pieces (text, ids,
    logprobs; the prompt's logprobs with the first) that concatenate to it, n = 2 samples each on its own;
    CUMULATIVE is the default. A bad kind names the field."""
    from tdpipe import RequestOutputKind

    async def main():
        llm = await AsyncLLM.start(cfg())
        try:
            base = dict(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2, prompt_logprobs=1)
            final = await collect(llm, PROMPTS[1], SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY),
                                  "final")
            assert len(final) == 1 and final[0].finished
            assert final[0].outputs[0].token_ids == offline[1].outputs[0].token_ids
            pieces = await collect(llm, PROMPTS[1], SamplingParams(**base, output_kind=RequestOutputKind.DELTA),
                                   "delta")
            assert len(pieces) > 1 and pieces[-1].finished
            whole = final[0].outputs[0]
            assert [t for p in pieces for t in p.outputs[0].token_ids] == whole.token_ids
            assert "".join(p.outputs[0].text for p in pieces) == whole.text
            assert [e for p in pieces for e in p.outputs[0].logprobs] == whole.logprobs
            assert pieces[0].prompt_logprobs == final[0].prompt_logprobs
            assert all(p.prompt_logprobs is None for p in pieces[1:])
            two = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
            ref = (await collect(llm, PROMPTS[2], two, "two-cum"))[-1]
            parts = await collect(llm, PROMPTS[2], dataclasses.replace(two, output_kind=1), "two-delta")
            for j in range(2):
                got = [t for p in parts for c in p.outputs if c.index == j for t in c.token_ids]
                assert got == next(c.token_ids for c in ref.outputs if c.index == j)
        finally:
            await llm.shutdown()

    asyncio.run(main())
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=1, best_of=2, output_kind=RequestOutputKind.DELTA)


@pytest.mark.parametrize("pp", [1, 2])
def test_streams_growing_text_identical_to_llm_generate(offline, pp):
    async def main():
        llm = await AsyncLLM.start(cfg(pp))
        try:
            sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            runs = await asyncio.gather(*[collect(llm, p, sp, f"r{i}") for i, p in enumerate(PROMPTS)])
            for outs, ref in zip(runs, offline):
                assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
                ids = [o.outputs[0].token_ids for o in outs]
                assert all(b[:len(a)] == a for a, b in zip(ids, ids[1:]))  # cumulative
                assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
                assert outs[-1].outputs[0].text == ref.outputs[0].text
                assert outs[-1].outputs[0].finish_reason == "length"
            st = await wait_idle(llm)
            assert st["generation_tokens"] == 16 * len(PROMPTS) and len(st["stage_busy"]) == pp
        finally:
            await llm.shutdown()
    asyncio.run(main())


def test_leaving_early_abort_rejects_and_death():
    async def main():
        llm = await AsyncLLM.start(cfg())
        core_pid = llm._proc.pid
        try:
            long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            # a consumer that stops iterating aborts its request: blocks back within a step
            agen = llm.generate(PROMPTS[0], long, "early")
            async for o in agen:
                if len(o.outputs[0].token_ids) >= 3:
                    break
            await agen.aclose()
            # abort() ends the iterator with finish_reason "abort"
            task = asyncio.create_task(collect(llm, PROMPTS[1], long, "ab"))
            await asyncio.sleep(0.3)
            await llm.abort("ab")
            outs = await task
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
            await wait_idle(llm)
            # refused before the first output, naming the problem; the engine keeps serving
            with pytest.raises(ValueError, match="maximum context length"):
                await collect(llm, [5] * 5000, SamplingParams(max_tokens=4), "long")
            with pytest.raises(ValueError, match="empty"):
                await collect(llm, [], SamplingParams(max_tokens=4), "empty")
            with pytest.raises(ValueError, match="prompt: character 2 is an unpaired UTF-16 surrogate"):
                await collect(llm, "a \ud800", SamplingParams(max_tokens=4), "surrogate")
            outs = await collect(llm, PROMPTS[2], SamplingParams(temperature=0, max_tokens=4), "ok")
            assert outs[-1].finished
            # stop strings end a request in the frontend and the core drops it
            outs = await collect(llm, "1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=40, stop=[" 7"]), "st")
            assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == " 7"
            assert " 7" not in outs[-1].outputs[0].text and outs[-1].outputs[0].text.strip().endswith("6,")
            await wait_idle(llm)
            # the core dies: every open request raises EngineDeadError, and the handle says why
            tasks = [asyncio.create_task(collect(llm, p, long, f"d{i}")) for i, p in enumerate(PROMPTS)]
            await asyncio.sleep(0.5)
            os.kill(core_pid, signal.SIGKILL)
            for t in tasks:
                with pytest.raises(EngineDeadError, match="signal 9"):
                    await t
            assert "signal 9" in llm.dead_reason
            with pytest.raises(EngineDeadError):
                llm.check_health()
            with pytest.raises(EngineDeadError):
                await collect(llm, "x", SamplingParams(max_tokens=2), "after")
        finally:
            await llm.shutdown()
    asyncio.run(main())


def test_shutdown_leaves_no_process_pp2():
    async def main():
        llm = await AsyncLLM.start(cfg(2))
        core_pid = llm._proc.pid
        stages = stage_pids_of(core_pid)
        assert len(stages) == 2
        sp = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        tasks = [asyncio.create_task(collect(llm, p, sp, f"s{i}")) for i, p in enumerate(PROMPTS)]
        await asyncio.sleep(0.5)
        await llm.shutdown(grace_s=0.5)  # in flight: aborted after the grace period
        for t in tasks:
            outs = await t
            assert outs[-1].outputs[0].finish_reason == "abort"
        return [core_pid, *stages]
    pids = asyncio.run(main())
    assert not any(alive(p) for p in pids)
