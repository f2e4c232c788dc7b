"""The data-parallel client without processes: cores split per replica, the KV budget split, requests to the
least-loaded replica, stats merged as one engine's, a dead replica is the engine's death."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tdpipe.config import EngineConfig, ParallelConfig, available_memory, kv_budget
from tdpipe.core.data_parallel import DataParallelClient, replica_config, replica_cpus
from tdpipe.core.validation import EngineRequest
from tdpipe.outputs import CompletionOutput, RequestOutput
from tdpipe.sampling.params import SamplingParams


def test_cores_split_in_contiguous_groups():
    assert replica_cpus(2, [3, 0, 2, 1]) == [[0, 1], [2, 3]]
    assert replica_cpus(2, [0, 1, 2]) == [[0], [1]]  # the remainder stays unused
    with pytest.raises(ValueError, match="data_parallel_size 3 needs at least 3 cores"):
        replica_cpus(3, [0, 1])


def test_replica_config_splits_the_default_and_fractions_not_bytes():
    cfg = EngineConfig(parallel=ParallelConfig(data_parallel_size=2))
    one = replica_config(cfg)
    assert one.parallel.data_parallel_size == 1
    assert abs(one.cache.kv_cache_memory - kv_budget(None, available_memory()) // 2) < 64 << 20
    frac = replica_config(dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, kv_cache_memory=0.2)))
    assert abs(frac.cache.kv_cache_memory - int(0.1 * available_memory())) < 64 << 20
    exact = replica_config(dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, kv_cache_memory=1 << 30)))
    assert exact.cache.kv_cache_memory == 1 << 30  # bytes are each replica's
    with pytest.raises(ValueError, match="CPU only"):
        replica_config(dataclasses.replace(cfg, parallel=ParallelConfig(data_parallel_size=2, device="cuda")))
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        ParallelConfig(data_parallel_size=0)


class FakeReplica:
    def __init__(self, k: int) -> None:
        self.k, self.config, self.tokenizer, self.model_name = k, EngineConfig(), None, "m"
        self.max_model_len, self.max_num_seqs, self.vocab_size = 100, 4, 1000
        self.default_sampling = {"temperature": 0.5}
        self.eos_token_ids = frozenset({2})
        self.ready, self.dead_reason, self.death_detail, self.failed_on_death, self.log_death = True, None, None, 0, True
        self.got: list[str] = []
        self.release = asyncio.Event()

    async def generate(self, req: EngineRequest):
        self.got.append(req.request_id)
        await self.release.wait()
        yield RequestOutput(req.request_id, None, req.prompt_token_ids, [CompletionOutput(0, "x", [1], "stop")],
                            finished=True)

    def check_health(self) -> None:
        if self.dead_reason:
            raise RuntimeError(self.dead_reason)

    def stats(self) -> dict:
        return {"num_running": 1 + self.k, "num_waiting": 0, "num_blocks": 100, "num_free_blocks": 50 + 25 * self.k,
                "kv_usage": 0.5 - 0.25 * self.k, "num_preemptions": self.k, "prompt_tokens": 10,
                "generation_tokens": 5, "prefix_cache_queries": 4, "prefix_cache_hits": 1 + self.k,
                "num_requests": 1, "num_unfinished": 1, "stage_busy": [0.4 + 0.2 * self.k]}


def test_requests_go_to_the_least_loaded_replica_and_stats_merge():
    async def run() -> None:
        reps = [FakeReplica(0), FakeReplica(1)]
        dp = DataParallelClient(reps)  # type: ignore[arg-type]
        assert dp.default_sampling == {"temperature": 0.5}  # the model's, as every replica read it

        def req(rid: str, n: int, max_tokens: int) -> EngineRequest:
            return EngineRequest(rid, list(range(n)), SamplingParams(max_tokens=max_tokens))

        async def drain(r: EngineRequest) -> None:
            async for _ in dp.generate(r):
                pass

        tasks = [asyncio.ensure_future(drain(req("big", 50, 50)))]
        await asyncio.sleep(0)
        for rid in ("a", "b", "c"):  # 10 + 10 tokens each: all three fit beside "big" before it is outweighed
            tasks.append(asyncio.ensure_future(drain(req(rid, 10, 10))))
            await asyncio.sleep(0)
        assert reps[0].got == ["big"] and reps[1].got == ["a", "b", "c"]
        assert dp.load == [100, 60]
        with pytest.raises(ValueError, match="already running"):
            await drain(req("a", 1, 1))
        for r in reps:
            r.release.set()
        await asyncio.gather(*tasks)
        assert dp.load == [0, 0]
        s = dp.stats()
        assert s["num_running"] == 3 and s["num_free_blocks"] == 125 and s["kv_usage"] == pytest.approx(0.375)
        assert s["prefix_cache_hit_rate"] == pytest.approx(3 / 8) and s["stage_busy"] == [pytest.approx(0.5)]
        assert len(s["replicas"]) == 2
        assert dp.ready and dp.dead_reason is None
        reps[1].dead_reason, reps[1].death_detail = "the engine core failed", "boom"
        assert dp.dead_reason == "the engine core failed" and dp.death_detail == "replica 1: boom"
        with pytest.raises(RuntimeError):
            dp.check_health()

    asyncio.run(run())
