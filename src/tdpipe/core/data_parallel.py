"""Data parallelism on one machine (--data-parallel-size N): N engine replicas behind one EngineClient.

Each replica is an AsyncLLM with its own engine-core process (and, at pp > 1, its own stage processes), pinned
to its own slice of this process's cores, so the replicas never share a core (vLLM's one-engine-per-replica
design, without its cluster manager). A request goes to the replica with the least outstanding work: the
prompt tokens plus max_tokens of every request it holds (vLLM's DP balancer counts waiting and running
requests; tokens also weigh long requests). Outputs reach the caller as from one engine; the server, run-batch
and `LLM(data_parallel_size=N)` use it in place of an AsyncLLM.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any

from tdpipe.config import EngineConfig, available_memory, kv_budget
from tdpipe.core.async_llm import AsyncLLM
from tdpipe.core.engine_client import EngineDeadError, as_engine_request
from tdpipe.core.validation import EngineRequest
from tdpipe.outputs import RequestOutput
from tdpipe.sampling.params import SamplingParams

__all__ = ["DataParallelClient", "replica_config", "replica_cpus", "start_engine_client"]

# stats the replicas' snapshots are summed over; the rest is recomputed from them (stats())
_SUMMED = ("num_running", "num_waiting", "num_blocks", "num_free_blocks", "num_preemptions", "prompt_tokens",
           "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_requests", "num_unfinished")


def replica_cpus(n: int, cpus: list[int] | None = None) -> list[list[int]]:
    """This process's cores (or `cpus`) in n contiguous groups of equal size (the remainder unused): one per
    replica. ValueError when there are fewer cores than replicas."""
    have = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if n > len(have):
        raise ValueError(f"data_parallel_size {n} needs at least {n} cores; this process may use {len(have)}")
    per = len(have) // n
    return [have[k * per:(k + 1) * per] for k in range(n)]


def replica_config(config: EngineConfig) -> EngineConfig:
    """One replica's config: data_parallel_size 1, and the KV cache budget split between the replicas when
    it is the default or a fraction of memory (bytes given are each replica's). CPU only: replicas sharing one
    GPU would each size their cache for the whole device."""
    n = config.parallel.data_parallel_size
    if config.parallel.device == "cuda":
        raise ValueError("data_parallel_size > 1 runs on CPU only so far (replicas would share the GPU)")
    cache = config.cache
    if cache.num_blocks is None and not isinstance(cache.kv_cache_memory, int):
        cache = dataclasses.replace(cache, kv_cache_memory=kv_budget(cache.kv_cache_memory, available_memory()) // n)
    return dataclasses.replace(config, cache=cache,
                               parallel=dataclasses.replace(config.parallel, data_parallel_size=1))


async def start_engine_client(config: EngineConfig | None) -> "AsyncLLM | DataParallelClient":
    """The engine the config asks for, started: one AsyncLLM, or N replicas with data_parallel_size N."""
    if config is not None and config.parallel.data_parallel_size > 1:
        return await DataParallelClient.start(config)
    return await AsyncLLM.start(config)


class DataParallelClient:
    """N AsyncLLM replicas as one EngineClient (core/engine_client.py)."""

    def __init__(self, replicas: list[AsyncLLM]) -> None:
        self.replicas = replicas
        first = replicas[0]
        self.config = first.config
        self.tokenizer, self.model_name = first.tokenizer, first.model_name
        self.default_sampling = first.default_sampling
        self.eos_token_ids = first.eos_token_ids
        self.max_model_len, self.max_num_seqs, self.vocab_size = first.max_model_len, first.max_num_seqs, \
            first.vocab_size
        self.load = [0] * len(replicas)  # outstanding prompt + max_tokens per replica
        self._where: dict[str, int] = {}  # request id -> replica
        self.log_death = True

    @classmethod
    async def start(cls, config: EngineConfig) -> "DataParallelClient":
        """Start every replica at once (each loads the model); if one fails the others are stopped."""
        n = config.parallel.data_parallel_size
        one = replica_config(config)
        replicas = [AsyncLLM(one, cpus=cpus) for cpus in replica_cpus(n)]
        got = await asyncio.gather(*(r._start() for r in replicas), return_exceptions=True)
        failed = [g for g in got if isinstance(g, BaseException)]
        if failed:
            await asyncio.gather(*(r.shutdown(0) for r in replicas if r.ready), return_exceptions=True)
            raise failed[0]
        return cls(replicas)

    # -- what the server reads -------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return all(r.ready for r in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        """The first dead replica's reason: the server treats any replica's death as the engine's."""
        return next((r.dead_reason for r in self.replicas if r.dead_reason is not None), None)

    @property
    def death_detail(self) -> str | None:
        return next((f"replica {k}: {r.death_detail}" for k, r in enumerate(self.replicas)
                     if r.death_detail is not None), None)

    @property
    def failed_on_death(self) -> int:
        return sum(r.failed_on_death for r in self.replicas)

    @property
    def log_death(self) -> bool:
        return self.replicas[0].log_death

    @log_death.setter
    def log_death(self, value: bool) -> None:
        for r in self.replicas:
            r.log_death = value

    def check_health(self) -> None:
        for r in self.replicas:
            r.check_health()

    async def wait_dead(self) -> str:
        """Once any replica has died: its reason."""
        waits = [asyncio.ensure_future(r.wait_dead()) for r in self.replicas]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            return next(iter(done)).result()
        finally:
            for w in waits:
                w.cancel()

    def stats(self) -> dict[str, Any]:
        """The replicas' snapshots as one engine's: counts summed, KV usage over all blocks, per stage the
        mean busy ratio; `replicas` holds each one's own."""
        each = [r.stats() for r in self.replicas]
        out: dict[str, Any] = {k: sum(s.get(k, 0) for s in each) for k in _SUMMED}
        blocks = out["num_blocks"]
        out["kv_usage"] = (sum(s.get("kv_usage", 0.0) * s.get("num_blocks", 0) for s in each) / blocks
                           if blocks else 0.0)
        q = out["prefix_cache_queries"]
        out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / q if q else 0.0
        busy = [s.get("stage_busy", []) for s in each]
        out["stage_busy"] = [sum(b[i] for b in busy) / len(busy) for i in range(min(map(len, busy)))]
        out["replicas"] = each
        return out

    # -- requests --------------------------------------------------------------------------------------------
    def request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                text: str | None = None) -> EngineRequest:
        return self.replicas[0].request(prompt, params, request_id, text)

    def _pick(self) -> int:
        return min(range(len(self.replicas)), key=lambda k: (self.load[k], k))

    async def generate(self, prompt: EngineRequest | str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """AsyncLLM.generate on the least-loaded replica."""
        self.check_health()
        req = as_engine_request(prompt, params, request_id, self.request)
        if req.request_id in self._where:
            raise ValueError(f"request_id {req.request_id!r} is already running")
        k = self._pick()
        cost = len(req.prompt_token_ids) + (req.params.max_tokens or 0) * req.params.num_samples
        self.load[k] += cost
        self._where[req.request_id] = k
        try:
            async for out in self.replicas[k].generate(req):
                yield out
        finally:
            self.load[k] -= cost
            self._where.pop(req.request_id, None)

    async def abort(self, request_id: str) -> None:
        k = self._where.get(request_id)
        if k is not None:
            await self.replicas[k].abort(request_id)

    async def update_weights_from_disk(self, model_path: str, in_flight: str = "finish") -> int:
        """Every replica loads the folder (each as AsyncLLM does); the new weight version."""
        versions = await asyncio.gather(*(r.update_weights_from_disk(model_path, in_flight)
                                          for r in self.replicas))
        if len(set(versions)) != 1:
            raise EngineDeadError(f"the replicas disagree on the weight version after the update: {versions}")
        return versions[0]

    async def shutdown(self, grace_s: float = 10.0) -> None:
        await asyncio.gather(*(r.shutdown(grace_s) for r in self.replicas))
