"""Weights and memory between generate calls (core/weight_sync.py): update_weights from a folder at pp = 1 and
pp = 2 and from tensors in memory, the weight version in every output, sleep / wake_up and the memory they
give back. Two random Qwen2 checkpoints of one shape: A (the session's tiny model) and B (A's weights
perturbed), each also run alone as the reference."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tdpipe import LLM, SamplingParams

PROMPTS = [list(range(5, 25)), list(range(100, 131)), [7] * 9]
KV = 64 << 20


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _tensors(folder) -> list[tuple[str, torch.Tensor]]:
    return [kv for f in sorted(folder.glob("*.safetensors")) for kv in load_file(f).items()]


@pytest.fixture(scope="module")
def two_models(qwen2_tiny, tmp_path_factory):
    """(folder A, folder B, A's tokens, B's tokens): B is A with every weight perturbed by 20% noise."""
    from pathlib import Path

    a = Path(qwen2_tiny[0])
    b = tmp_path_factory.mktemp("weights_b")
    g = torch.Generator().manual_seed(1)
    for f in a.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v * (1 + 0.2 * torch.randn(v.shape, generator=g)).to(v.dtype)
                       for k, v in load_file(f).items()}, b / f.name, metadata={"format": "pt"})
        else:
            shutil.copy(f, b / f.name)
    with LLM(str(a), dtype="float32", kv_cache_memory=KV) as llm:
        ta = _greedy(llm)
    with LLM(str(b), dtype="float32", kv_cache_memory=KV) as llm:
        tb = _greedy(llm)
    assert ta != tb
    return a, b, ta, tb


@pytest.mark.parametrize("pp", [1, 2])
def test_update_weights_from_a_folder(two_models, pp):
    a, b, ta, tb = two_models
    with LLM(str(a), dtype="float32", pipeline_parallel_size=pp, kv_cache_memory=KV,
             enable_prefix_caching=True) as llm:
        assert _greedy(llm) == ta
        assert llm.update_weights(b) == 1
        assert _greedy(llm) == tb  # no cached prefix of A's KV is reused
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert out.weight_version == 1
        assert llm.update_weights(str(a)) == 2 and _greedy(llm) == ta


def test_update_weights_from_tensors_in_memory(two_models):
    a, b, ta, tb = two_models
    with LLM(str(a), dtype="float32", kv_cache_memory=KV) as llm:
        llm.update_weights(iter(_tensors(b)))
        assert _greedy(llm) == tb
        # a load that fails part-way leaves the weights of the folder last loaded, not a broken model
        with pytest.raises(Exception):
            llm.update_weights(_tensors(b)[:3])
        assert _greedy(llm) == ta and llm.engine.weight_version == 1
    with LLM(str(a), dtype="float32", pipeline_parallel_size=2, kv_cache_memory=KV) as llm:
        with pytest.raises(ValueError, match="checkpoint folder"):
            llm.update_weights(_tensors(b))
        assert _greedy(llm) == ta  # the refusal changed nothing
        with pytest.raises(ValueError, match="does not exist"):
            llm.update_weights(b / "no-such-folder")
        # a worker's error comes back naming the worker, and the pipeline stays usable
        with pytest.raises(RuntimeError, match=r"sleep failed on .*level must be 1 or 2"):
            llm.collective_rpc("sleep", (3,))
        assert _greedy(llm) == ta


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_sleep_frees_memory_and_wake_up_restores_it(two_models):
    a, _, ta, _ = two_models
    kv = 256 << 20
    with LLM(str(a), dtype="float32", kv_cache_memory=kv) as llm:
        assert _greedy(llm) == ta
        # the cache is an anonymous mapping whose pages become resident when first written: write them all,
        # or what sleep gives back depends on what ran before (a first start's step profile writes them)
        llm.engine.executor.runner.kv_cache.fill_(0)
        before = _rss()
        llm.sleep(1)
        asleep = _rss()
        with pytest.raises(RuntimeError, match="wake_up"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], use_tqdm=False)
        llm.wake_up()
        assert _greedy(llm) == ta
        llm.sleep(2)
        llm.wake_up()
        assert _greedy(llm) == ta
    assert before - asleep > kv // 2, f"sleep(1) gave back {(before - asleep) >> 20} MiB of a {kv >> 20} MiB cache"


@pytest.mark.parametrize("pp", [1, 2])
def test_wake_up_by_parts_as_rl_loops_do(two_models, pp):
    """vLLM's wake_up(tags=...): the weights first, then new weights, then the KV cache (an RL loop never
    holds new weights beside the old cache); generate() waits for both parts, bad tags name the field."""
    a, b, _, tb = two_models
    with LLM(str(a), dtype="float32", kv_cache_memory=KV, pipeline_parallel_size=pp) as llm:
        llm.sleep(2)
        with pytest.raises(RuntimeError, match="asleep"):
            llm.update_weights(b)
        llm.wake_up(tags=["weights"])
        assert llm.engine.asleep == {"kv_cache"}
        with pytest.raises(RuntimeError, match="wake_up"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], use_tqdm=False)
        llm.update_weights(b)
        llm.wake_up(tags=["kv_cache"])
        assert not llm.engine.sleeping and _greedy(llm) == tb
        for bad in ("weights", [], ["gpu"]):
            with pytest.raises(ValueError, match="wake_up tags"):
                llm.wake_up(tags=bad)


def test_sleep_and_updates_need_an_idle_engine(two_models):
    a, b, _, _ = two_models
    with LLM(str(a), dtype="float32", kv_cache_memory=KV) as llm:
        llm.engine.add_request("busy", PROMPTS[0], SamplingParams(max_tokens=4))
        with pytest.raises(RuntimeError, match="1 request"):
            llm.sleep(1)
        llm.engine.step()  # now it holds KV: an update would change the weights under it
        with pytest.raises(RuntimeError, match="idle or paused engine: 1 request"):
            llm.update_weights(b)
        llm.engine.abort_request("busy")
        with pytest.raises(ValueError, match="level must be 1 or 2"):
            llm.sleep(3)
        llm.sleep(1)
        with pytest.raises(RuntimeError, match="asleep"):
            llm.update_weights(b)


def test_the_server_updates_weights_while_requests_run(two_models):
    """AsyncLLM (engine core in its own process) behind the HTTP app: a request in flight when the update
    arrives finishes on the old weights, one sent after it runs on the new, the route needs the API key."""
    import asyncio

    import httpx

    from tdpipe.config import CacheConfig, EngineConfig
    from tdpipe.core.async_llm import AsyncLLM
    from tdpipe.entrypoints.openai.api_server import build_app
    from tdpipe.entrypoints.openai.serve_args import ServerConfig

    a, b, ta, tb = two_models
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def last(llm, prompt, params, rid):
        return [o async for o in llm.generate(prompt, params, rid)][-1]

    async def main():
        llm = await AsyncLLM.start(EngineConfig(model=str(a), dtype="float32", cache=CacheConfig(kv_cache_memory=KV)))
        try:
            app = build_app(llm, ServerConfig(api_key="secret"))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                r = await http.post("/update_weights_from_disk", json={"model_path": str(b)})
                assert r.status_code == 401
                old = asyncio.ensure_future(last(llm, PROMPTS[0], long, "old"))
                await asyncio.sleep(0.2)  # in flight when the update arrives
                auth = {"Authorization": "Bearer secret"}
                update = asyncio.ensure_future(http.post("/update_weights_from_disk", json={"model_path": str(b)},
                                                         headers=auth))
                await asyncio.sleep(0.05)
                assert not old.done() and not update.done()  # the update waits for the request in flight
                new = await last(llm, PROMPTS[0], sp, "new")  # sent after the update: waits for it
                r = await update
                assert r.status_code == 200 and r.json()["weight_version"] == 1, r.text
                assert (await old).outputs[0].token_ids[:8] == ta[0]
                assert new.outputs[0].token_ids == tb[0]
                assert (await old).weight_version == 0 and new.weight_version == 1
                r = await http.post("/update_weights_from_disk", json={"model_path": str(b / "nope")}, headers=auth)
                assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_an_update_that_recomputes_the_requests_in_flight(two_models):
    """in_flight "recompute": the update does not wait for the request in flight; that request is paused
    (preempted), keeps the tokens it had, and goes on after a recompute on the new weights."""
    import asyncio

    from tdpipe.config import CacheConfig, EngineConfig
    from tdpipe.core.async_llm import AsyncLLM

    a, b, ta, tb = two_models
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main():
        llm = await AsyncLLM.start(EngineConfig(model=str(a), dtype="float32", cache=CacheConfig(kv_cache_memory=KV)))
        try:
            got: list = []
            started = asyncio.Event()

            async def run_long():
                async for o in llm.generate(PROMPTS[0], long, "long"):
                    got.append(o)
                    if len(o.outputs[0].token_ids) >= 8:
                        started.set()

            task = asyncio.ensure_future(run_long())
            await started.wait()
            with pytest.raises(ValueError, match="in_flight must be one of finish, recompute"):
                await llm.update_weights_from_disk(str(b), "pause")
            assert await llm.update_weights_from_disk(str(b), "recompute") == 1
            assert not task.done()  # it did not wait for the request in flight
            new = [o async for o in llm.generate(PROMPTS[0], sp, "new")][-1]
            await task
            final = got[-1].outputs[0].token_ids
            assert len(final) == 300 and final[:8] == ta[0]  # its first tokens came from the old weights
            assert new.outputs[0].token_ids == tb[0]
            for _ in range(50):  # the stats snapshot comes with the next step
                if llm.stats()["num_preemptions"] >= 1:
                    break
                await asyncio.sleep(0.1)
            assert llm.stats()["num_preemptions"] >= 1  # paused by recompute preemption
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_rollout_hooks_reset_prefix_cache_detokenize_and_vllm_names(two_models):
    """What RL loops call on vLLM's LLM: reset_prefix_cache() (refused, False, while a request holds KV),
    SamplingParams(detokenize=False) (the same token ids, no text), llm_engine, get_default_sampling_params()."""
    a, _, ta, _ = two_models
    with LLM(str(a), dtype="float32", kv_cache_memory=KV, enable_prefix_caching=True) as llm:
        assert llm.llm_engine is llm.engine and llm.get_default_sampling_params() == SamplingParams()
        assert _greedy(llm) == ta
        bm = llm.engine.block_manager
        assert bm.cache.table  # the prompts' full blocks are named
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False,
                                           logprobs=1), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == ta
        assert all(o.outputs[0].text == "" for o in outs)
        assert all(lp.decoded_token is None for o in outs for d in o.outputs[0].logprobs for lp in d.values())
        llm.engine.add_request("busy", PROMPTS[0], SamplingParams(max_tokens=4))
        llm.engine.step()
        assert llm.reset_prefix_cache() is False and bm.cache.table  # refused, nothing touched
        llm.engine.abort_request("busy")
        assert llm.reset_prefix_cache() is True
        assert not bm.cache.table and bm.num_free_blocks == bm.num_blocks
        assert _greedy(llm) == ta
