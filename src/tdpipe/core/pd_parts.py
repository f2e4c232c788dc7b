"""The parts of a disaggregated engine (`disaggregation="pd"`, docs/disaggregation.md), built by the engine
builder in place of the colocated executor and scheduler: P prefill and D decode instances, each an executor
with its own KV cache (a worker process pinned to its own cores; in this process for an in-memory model, as
in the tests), the shared KV staging area they exchange blocks through (worker/kv_transfer.py), and the
PDScheduler with one page table per instance (core/scheduler/pd.py)."""
from __future__ import annotations

import itertools
import logging
import os
import tempfile
from typing import Any, Callable

from tdpipe.core.block_manager import BlockManager
from tdpipe.core.kv_staging import StagingSlots
from tdpipe.core.scheduler.pd import PDScheduler
from tdpipe.executor.base import Executor
from tdpipe.executor.pd import PDExecutor
from tdpipe.model.kv_quant import cache_layout
from tdpipe.worker.kv_transfer import create_staging_file, staging_shape

log = logging.getLogger("tdpipe")
_files = itertools.count()


def instance_blocks(builder: Any, num_blocks: int) -> int:
    """KV blocks of each instance: a default or fractional budget is split between the P + D instances (as
    between data-parallel replicas); bytes or --num-kv-blocks given are each instance's."""
    par, cache = builder.config.parallel, builder.config.cache
    n = par.prefill_workers + par.decode_workers
    if cache.num_blocks is None and not isinstance(cache.kv_cache_memory, int):
        num_blocks = max(1, num_blocks // n)
    sched = builder.config.scheduler
    capacity = num_blocks * cache.block_size
    if capacity < sched.max_model_len:
        log.warning("each of the %d disaggregated instances holds %d KV tokens: max_model_len lowered from %d",
                    n, capacity, sched.max_model_len)
        sched.max_model_len = capacity
    return num_blocks


def instance_cpus(n: int) -> list[list[int] | None]:
    """This process's cores in n equal groups, one per instance; unpinned (None each) with fewer cores than
    instances."""
    have = sorted(os.sched_getaffinity(0))
    if len(have) < n:
        log.warning("%d disaggregated instances on %d cores: they share the cores (not pinned)", n, len(have))
        return [None] * n
    per = len(have) // n
    return [have[k * per:(k + 1) * per] for k in range(n)]


def make_pd_executor(builder: Any, num_blocks: int, weights: Callable[[], Any] | None) -> PDExecutor:
    """Every instance's executor (`weights`: each in-memory instance's (name, tensor) pairs; None: load the
    model folder in a worker process), the staging area mapped by each (then unlinked: nothing is left behind in
    /dev/shm whatever happens to the processes)."""
    par, mc, cache = builder.config.parallel, builder.model_config, builder.config.cache
    if builder.kv_pools.window:
        raise ValueError("disaggregation 'pd' does not support models with sliding-window layers yet "
                         "(their KV lives in a pool of its own)")
    if builder.platform.name != "cpu":
        raise ValueError(f"device is {builder.platform.name}: disaggregation 'pd' runs on cpu only so far")
    n = par.prefill_workers + par.decode_workers
    sched = builder.config.scheduler
    builder.pd_num_slots = par.kv_transfer_blocks or max(-(-sched.max_model_len // cache.block_size), num_blocks // 4)
    kv_dtype, width = cache_layout(mc.kv_cache_dtype, builder.dtype, mc.head_dim)  # the instances' cache rows
    shape = staging_shape(builder.pd_num_slots, mc.num_layers, mc.num_kv_heads, cache.block_size, width)
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"tdpipe-kv-{os.getpid()}-{next(_files)}")
    create_staging_file(path, shape, kv_dtype)
    builder.partition, builder.lm_head_split = [(0, mc.num_layers)], 0.0
    instances: list[Executor] = []
    try:
        cpus = instance_cpus(n)  # equal groups (or all unpinned): every instance gets the same threads
        threads = par.threads_per_stage or (len(cpus[0]) if cpus[0] else 1)
        for k in range(n):
            instances.append(_instance(builder, num_blocks, weights, cpus[k], threads))
        for ex in instances:
            ex.collective_rpc("attach_kv_staging", (path, shape))
    except BaseException:
        for ex in instances:
            ex.shutdown()
        raise
    finally:
        os.unlink(path)
    builder.stage_threads = [threads]
    log.info("disaggregated: %d prefill + %d decode instances, %d KV blocks each, %d staging blocks, threads %d",
             par.prefill_workers, par.decode_workers, num_blocks, builder.pd_num_slots, threads)
    return PDExecutor(instances, par.prefill_workers)


def _instance(builder: Any, num_blocks: int, weights: Callable[[], Any] | None,
              cpus: list[int] | None, threads: int) -> Executor:
    """One instance: the model whole, in a worker process (a model folder) or in this process (in memory)."""
    cache = builder.config.cache
    if weights is not None:  # in-memory weights: no folder for a worker to load; the tests' fast path
        from tdpipe.executor.local import LocalExecutor
        from tdpipe.worker.model_runner import ModelRunner

        runner = ModelRunner(builder.model_config, builder.model_path, builder.dtype, num_blocks, cache.block_size,
                             weights=weights())
        return LocalExecutor(runner)
    from tdpipe.pipeline.executor import PipelineExecutor, StageSpec

    cfg = builder.config.scheduler
    return PipelineExecutor(builder.model_config, builder.model_path, builder.dtype, num_blocks, cache.block_size,
                            [StageSpec(0, builder.model_config.num_layers, threads)],
                            max(cfg.max_num_batched_tokens, cfg.max_model_len), builder.platform, cpus=cpus)


def make_pd_scheduler(builder: Any, num_blocks: int) -> PDScheduler:
    """One page table per instance (prefix caching on the prefill side only) and the staging slots."""
    par, cache = builder.config.parallel, builder.config.cache
    prefill = [BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
               for _ in range(par.prefill_workers)]
    decode = [BlockManager(num_blocks, cache.block_size) for _ in range(par.decode_workers)]
    return PDScheduler(builder.config.scheduler, prefill, decode, StagingSlots(builder.pd_num_slots),
                       builder.eos_token_ids)


__all__ = ["instance_blocks", "instance_cpus", "make_pd_executor", "make_pd_scheduler"]
