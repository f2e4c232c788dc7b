"""Everything that happens once, before an engine's first step: the parts an `LLMEngine` runs with.

In order: the model (resolved to a folder and checked whole, or an in-memory config with random weights),
the tokenizer and end-of-sequence ids, the KV cache's size (which may lower max_model_len), the length
predictor and the history writer, the layer partition (timed on a throwaway model when pp > 1) and the
executor, the step-cost profile on that executor (TD-Pipe §3.5), and last the scheduler, which is given the
eos ids and the measured costs at construction. The engine (core/engine.py) only runs the loop.

`executor_factory`: build the executor from the builder's parts so far (model_config, partition,
block_manager; `scheduler` once built) instead of loading weights; the simulator (sim/executor.py) runs the
same loop this way. Such an engine, and one built from an in-memory config, loads no tokenizer: requests
come as token ids.
"""
from __future__ import annotations

import dataclasses

import itertools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from tdpipe.config import EngineConfig, ModelConfig, default_threads
from tdpipe.core.batched_predictor import BatchedPredictor
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.engine_stats import EngineStats
from tdpipe.core.kv_pools import KVPools, size_kv_pools
from tdpipe.core.pd_parts import instance_blocks, make_pd_executor, make_pd_scheduler
from tdpipe.core.scheduler import Scheduler, get_policy, make_scheduler
from tdpipe.core.step_profile import ProfileTarget, load_or_measure, measure
from tdpipe.executor.base import Executor
from tdpipe.interrupt import result_or_interrupt
from tdpipe.model.jit import import_build_tools
from tdpipe.model.weights import MissingModelFile, check_model_folder, check_tokenizer_files, load_hf_config
from tdpipe.pipeline import prefork, zygote
from tdpipe.platforms import get_platform, resolve_device
from tdpipe.platforms.interface import Platform
from tdpipe.predictor.base import Predictor
from tdpipe.predictor.factory import make_predictor
from tdpipe.sampling.defaults import model_sampling_defaults
from tdpipe.tokenizer import load_tokenizer_in_background

log = logging.getLogger("tdpipe")

IN_MEMORY = "<in-memory random weights>"  # model_path of an engine built from a config dict
SIM_PROFILE_BATCH = 512  # a simulated executor is profiled up to here, past where GPU decode turns compute-bound


def resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    """--dtype: bfloat16 or float32 as named; auto: the platform's default."""
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name in ("float32", "fp32"):
        return torch.float32
    return platform.default_dtype()


@dataclass
class EngineParts:
    """What an LLMEngine runs with, ready to run."""

    config: EngineConfig
    platform: Platform  # the device the model runs on (tdpipe/platforms)
    model_path: str
    model_config: ModelConfig
    tokenizer: Any | None  # None: requests come as token ids (simulated or in-memory model)
    eos_token_ids: set[int]
    dtype: torch.dtype
    block_manager: BlockManager
    predictor: Predictor
    batched_predictor: BatchedPredictor | None  # the scheduler's view when predictions are batched
    history: Any | None  # predictor.history.HistoryWriter with --record-history
    scheduler: Scheduler
    executor: Executor
    partition: list[tuple[int, int]]
    lm_head_split: float
    stage_threads: list[int]
    stats: EngineStats
    seq_ids: Iterator[int]  # sequence ids; profiling took the first ones
    default_sampling: dict[str, Any]  # the model's sampling defaults (sampling/defaults.py)


class EngineBuilder:
    """Builds the parts step by step; an `executor_factory` is handed the builder itself, with the parts
    built so far as attributes."""

    def __init__(self, config: EngineConfig, executor_factory: Callable[[Any], Executor] | None = None,
                 hf_config: dict[str, Any] | None = None, seed: int = 0) -> None:
        """`hf_config`: a Hugging Face config dict to build the model from instead of `config.model`'s
        folder: with random weights drawn from `seed` in memory (pp = tp = 1), or for an executor_factory."""
        self.config = config
        self.executor_factory = executor_factory
        self.hf_config = hf_config
        self.weights_seed = seed
        self.scheduler: Scheduler | None = None

    def build(self) -> EngineParts:
        from tdpipe.pipeline.processes import run_stage_if_worker

        config, par, sched = self.config, self.config.parallel, self.config.scheduler
        run_stage_if_worker(par.pipeline_parallel_size, par.tensor_parallel_size)  # torchrun ranks > 0: workers
        if self.executor_factory is None and self.hf_config is None and prefork.stages_for(par) > prefork.reserved():
            zygote.warm()  # the stages come from this process's zygote: its imports overlap this build
        # a simulated executor runs nothing on a device: its engine is this host's, sized as on CPU
        self.platform = get_platform("cpu" if self.executor_factory else resolve_device(par.device))
        self.pp, self.tp = par.pipeline_parallel_size, par.tensor_parallel_size
        # allocator settings (CPU: per-step [batch, vocab] tensors must not fragment the heap, tdpipe/malloc.py)
        # and threads: workers of their own own the cores; the engine process only samples and schedules
        workers = par.world_size > 1 or par.disaggregation != "none"
        self.platform.configure_process(config.num_threads or (1 if workers else default_threads()))
        self.dtype = resolve_dtype(config.dtype, self.platform)  # before the model: a GGUF converts to it
        hf = self._load_model()
        num_blocks = self._size_kv_cache()
        sched.pipeline_depth = sched.pipeline_depth or self.pp  # one micro-batch per stage unless asked
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                          self.kv_pools.window, self.kv_pools.num_window_blocks)
        policy = get_policy(sched.policy)  # what the policy needs: a length predictor, measured step costs
        policy.configure(sched)  # its token budget and knobs: the executor and the profile read them
        self.predictor = make_predictor(sched.predictor, None if hf is not None else self.model_path)
        history = self._history_writer()
        pd = par.disaggregation == "pd"  # prefill and decode instances of their own (core/pd_parts.py)
        if pd:
            num_blocks = instance_blocks(self, num_blocks)
            self.executor = make_pd_executor(self, num_blocks, None if hf is None else
                                             lambda: random_weights(hf, self.weights_seed))
        else:
            self.executor = self._make_executor(num_blocks, hf)
        prefork.release()  # forked stages this process reserved and no executor took
        try:
            pending = self._pending_tokenizer
            self.tokenizer = result_or_interrupt(pending) if pending is not None else None
        except BaseException:
            self.executor.shutdown()  # its stages started while the tokenizer loaded
            raise
        self.eos_token_ids = self._eos_ids()
        stats = EngineStats(started=self.executor.now())
        # a learned predictor encodes prompts in batches as they arrive, for the policies that ask for lengths
        batched = BatchedPredictor(self.predictor, stats) if policy.needs_predictor and self.predictor.batched else None
        self.seq_ids = itertools.count()
        torch.manual_seed(config.seed)
        costs = self._profile(hf is not None) if policy.wants_step_costs(sched) and not pd else None
        if pd:
            sched.pipeline_depth = par.prefill_workers + par.decode_workers  # one micro-batch per instance
            self.scheduler = make_pd_scheduler(self, num_blocks)
            self.block_manager = self.scheduler.decode[0].bm  # the engine's KV usage: the first decode instance's
        else:
            self.scheduler = make_scheduler(sched, self.block_manager, predictor=batched or self.predictor,
                                            eos_token_ids=self.eos_token_ids, costs=costs)
        return EngineParts(config, self.platform, self.model_path, self.model_config, self.tokenizer,
                           self.eos_token_ids, self.dtype, self.block_manager, self.predictor, batched, history,
                           self.scheduler, self.executor, self.partition, self.lm_head_split, self.stage_threads,
                           stats, self.seq_ids, self._sampling_defaults())

    # -- the model ---------------------------------------------------------------------------------------
    def _with_quantization(self, mc: ModelConfig) -> ModelConfig:
        """The model config carries --quantization (model/quantization.py) and --kv-cache-dtype
        (model/kv_quant.py) to every stage."""
        from tdpipe.model.quantization import check_quantization, resolve_quantization

        method = self.config.quantization
        if method != "auto":
            check_quantization(method, self.platform.name)
        model = self.config.model if self.hf_config is None else ""  # an in-memory config has no file
        method, gguf_file = resolve_quantization(method, model, self.platform.name, self.dtype == torch.bfloat16)
        from tdpipe.model.kv_quant import check_kv_cache_dtype

        kv = check_kv_cache_dtype(self.config.cache.kv_cache_dtype, self.platform.name)
        return dataclasses.replace(mc, quantization=method, gguf_file=gguf_file, kv_cache_dtype=kv)

    def _load_model(self) -> dict[str, Any] | None:
        """The model's config and tokenizer; returns the in-memory config dict, or None for a folder."""
        from tdpipe.model.bundled import resolve_model

        self.tokenizer = self._pending_tokenizer = None
        if self.hf_config is not None:
            if self.executor_factory is None and (self.pp != 1 or self.tp != 1):
                raise ValueError("an engine from an in-memory model config runs at pipeline_parallel_size = "
                                 "tensor_parallel_size = 1 (stage processes load weights from a folder)")
            self.model_path = IN_MEMORY
            hf = {"architectures": ["LlamaForCausalLM"], "num_key_value_heads": self.hf_config["num_attention_heads"],
                  **self.hf_config}
            self.model_config = self._with_quantization(ModelConfig.from_hf(hf))
            return hf
        self.model_path = resolve_model(self.config.model, "float32" if self.dtype == torch.float32 else None)
        simulated = self.executor_factory is not None
        # every part of the folder checked before anything heavy starts (stages, kernels): one clear line
        tok_path = self.config.tokenizer or self.model_path
        load_tok = not simulated and not self.config.skip_tokenizer_init
        hf = load_hf_config(self.model_path) if simulated else check_model_folder(self.model_path, tokenizer=False)
        if load_tok:  # the tokenizer's folder (--tokenizer's, or the model's) checked once, before anything starts
            if self.config.tokenizer is not None and not os.path.isdir(self.config.tokenizer):
                raise MissingModelFile(f"tokenizer {self.config.tokenizer}: not a folder (give the folder that "
                                       "holds tokenizer.json or the model's other tokenizer files)")
            check_tokenizer_files(tok_path)
        self.model_config = self._with_quantization(ModelConfig.from_hf(hf))
        if load_tok:  # loads while the executor starts; joined in build()
            if self.platform.name == "cpu":  # the kernels' loader imports setuptools: not beside the thread
                import_build_tools()
            self._pending_tokenizer = load_tokenizer_in_background(tok_path)
        return None

    def _sampling_defaults(self) -> dict[str, Any]:
        """What the model's generation_config.json sets for requests that leave it out (--generation-config)."""
        override = self.config.override_generation_config
        if self.hf_config is not None:  # an in-memory config has no folder
            return model_sampling_defaults(None, "vllm", override)
        return model_sampling_defaults(self.model_path, self.config.generation_config, override)

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        if self.hf_config is None:
            try:
                with open(os.path.join(self.model_path, "generation_config.json")) as f:
                    e = json.load(f).get("eos_token_id")
                ids.update([e] if isinstance(e, int) else (e or []))
            except (OSError, ValueError):
                pass
        return ids

    # -- the KV cache ------------------------------------------------------------------------------------
    def _size_kv_cache(self) -> int:
        """Blocks the KV budget holds; max_model_len defaults to the model's and is lowered (visibly) to
        what the cache holds."""
        sched, cache, mc = self.config.scheduler, self.config.cache, self.model_config
        if sched.max_model_len <= 0:
            sched.max_model_len = mc.max_position_embeddings
        elif sched.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len ({sched.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({mc.max_position_embeddings})")
        dtype_bytes = torch.finfo(self.dtype).bits // 8
        # the KV heads the ranks hold together: more than the model's where tp replicates them
        held = max(mc.num_kv_heads, self.config.parallel.tensor_parallel_size)
        block_bytes = mc.kv_bytes_per_token(dtype_bytes) * cache.block_size * held // mc.num_kv_heads
        budget = 0
        if cache.num_blocks is None:
            budget = self.platform.kv_cache_bytes(cache.kv_cache_memory, cache.gpu_memory_utilization,
                                                  mc.num_params() * dtype_bytes)
        num_blocks = cache.num_blocks or budget // block_bytes
        self.kv_pools = KVPools(num_blocks, capacity_tokens=num_blocks * cache.block_size)
        # sliding-window layers get a pool of their own (core/kv_pools.py); a simulated executor keeps them
        # in the global table
        if mc.has_local_layers and self.executor_factory is None:
            policy = get_policy(sched.policy)
            policy.configure(sched)  # its token budget: a chunked prefill step bounds the local pool
            step = sched.max_num_batched_tokens if policy.cls.chunks_prefill else sched.max_model_len
            own = (num_blocks * block_bytes if cache.num_blocks else budget) * mc.num_kv_heads // held
            self.kv_pools = size_kv_pools(mc, own, cache.block_size, dtype_bytes, sched.max_model_len, step,
                                          sched.max_num_seqs)  # `own`: the bytes one copy of the KV heads gets
            num_blocks = self.kv_pools.num_blocks
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes hold no KV block (one block of "
                             f"{cache.block_size} tokens needs {block_bytes} bytes for this model in "
                             f"{str(self.dtype).removeprefix('torch.')})")
        capacity = self.kv_pools.capacity_tokens if self.kv_pools.window else num_blocks * cache.block_size
        if capacity < sched.max_model_len:
            # visible: every request is cut to this length, so a silent change would look like a short answer
            log.warning("the KV cache holds only %d tokens (%d blocks of %d): max_model_len lowered from %d to "
                        "%d; a prompt and its output must fit in it (raise --kv-cache-memory for more)",
                        capacity, capacity // cache.block_size, cache.block_size, sched.max_model_len, capacity)
            sched.max_model_len = capacity
        return num_blocks

    def _history_writer(self) -> Any | None:
        if not self.config.record_history:
            return None
        from tdpipe.predictor.history import HistoryWriter

        return HistoryWriter(self.config.record_history, model=os.path.basename(os.path.normpath(self.model_path)))

    # -- partition and executor --------------------------------------------------------------------------
    def _make_executor(self, num_blocks: int, hf: dict[str, Any] | None) -> Executor:
        from tdpipe.worker.partition import resolve_partition

        par = self.config.parallel
        if self.executor_factory is not None:
            self.partition = resolve_partition(self.model_config, self.pp, par.layer_partition)
            self.lm_head_split = par.lm_head_split or 0.0
            self.stage_threads = [par.stage_threads()] * self.pp
            return self.executor_factory(self)
        self._choose_partition()
        if self.pp == 1 and self.tp == 1:
            from tdpipe.executor.local import LocalExecutor
            from tdpipe.worker.model_runner import ModelRunner

            weights = None if hf is None else random_weights(hf, self.weights_seed)
            runner = ModelRunner(self.model_config, self.model_path, self.dtype, num_blocks,
                                 self.config.cache.block_size, device=str(self.platform.set_device(0)),
                                 weights=weights, graphs=self._graph_settings(),
                                 num_window_blocks=self.kv_pools.num_window_blocks)
            self.stage_threads = [torch.get_num_threads()]
            return LocalExecutor(runner)
        from tdpipe.pipeline.executor import PipelineExecutor, StageSpec

        threads = par.stage_threads()
        self.stage_threads = [threads] * self.pp
        stages = [StageSpec(a, b, threads) for a, b in self.partition]
        cfg = self.config.scheduler  # separate and td-pipe send a lone prompt longer than the budget whole
        return PipelineExecutor(self.model_config, self.model_path, self.dtype, num_blocks,
                                self.config.cache.block_size, stages,
                                max(cfg.max_num_batched_tokens, cfg.max_model_len), self.platform, self.tp,
                                self.lm_head_split, graphs=self._graph_settings(),
                                num_window_blocks=self.kv_pools.num_window_blocks)

    def _graph_settings(self) -> Any:
        """The decode CUDA graphs the model runners capture (None: eager; worker/cuda_graph.py)."""
        from tdpipe.worker.cuda_graph import graph_settings

        c, sched = self.config, self.config.scheduler
        return graph_settings(self.platform.supports_cuda_graphs, c.enforce_eager, c.cuda_graph_sizes,
                              sched.max_num_seqs, sched.max_model_len)

    def _choose_partition(self) -> None:
        """Layers per stage and the lm_head split, balanced by measured time (a decode micro-batch and a
        prefill), not by layer count or FLOPs."""
        from tdpipe.worker.partition import choose_head_split, resolve_partition
        from tdpipe.worker.partition_cache import measured_costs

        par, mc = self.config.parallel, self.model_config
        split = par.lm_head_split  # None: auto (pp > 1, tp = 1 only)
        auto = split is None and self.pp > 1 and self.tp == 1
        counts = par.layer_partition
        costs = None
        if self.pp > 1 and (counts is None or auto):
            batch = max(8, min(128, self.config.scheduler.max_num_seqs // self.pp))
            costs = measured_costs(mc, self.dtype, par.stage_threads(), batch, self.platform,
                                   self.config.scheduler.profile_cache)
            if auto:
                split, counts = choose_head_split(mc, self.pp, costs, counts)
            costs = costs.with_split(split or 0.0)  # the costs the partition and the log below go by
        self.lm_head_split = split or 0.0
        self.partition = resolve_partition(mc, self.pp, counts, costs)
        if self.tp > 1:  # an unsplittable model fails here, naming its sizes, before any worker starts
            from tdpipe.model.tensor_parallel import head_split

            head_split(mc.num_heads, mc.num_kv_heads, self.tp)
        if self.pp > 1:
            log.info("layer partition %s (embedding on stage 0, norm + lm_head on stage %d, %.0f%% of the head "
                     "on stage 0; costs %s)", [b - a for a, b in self.partition], self.pp - 1,
                     100 * self.lm_head_split, costs)

    # -- step costs ----------------------------------------------------------------------------------------
    def _profile(self, in_memory: bool) -> Any:
        """Eq. 1-2 on costs measured on this executor. A simulated executor is profiled afresh (its clock is
        the cost model), and so is an in-memory model (nothing to key a cached profile by)."""
        target = ProfileTarget(self.executor, self.block_manager, self.config.scheduler, self.model_config,
                               self.model_path, self.dtype, self.pp, self.partition, self.stage_threads,
                               self.seq_ids.__next__)
        if self.executor_factory is not None:
            return measure(target, max_batch=SIM_PROFILE_BATCH)
        if in_memory:
            return measure(target)
        return load_or_measure(target, self.config.scheduler.profile_cache)


def random_weights(hf: dict[str, Any], seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a Llama/Qwen2 checkpoint with this config, drawn in memory as model/random_model.py
    writes them: normal(0, 0.02) linears and embeddings, unit norms, zero biases."""
    from tdpipe.model.random_model import tensor_shapes

    g = torch.Generator().manual_seed(seed)
    for name, shape, init in tensor_shapes(hf):
        if init == "normal":
            yield name, torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=g)
        else:
            yield name, (torch.ones if init == "ones" else torch.zeros)(shape, dtype=torch.float32)


def build_engine_parts(config: EngineConfig, executor_factory: Callable[[Any], Executor] | None = None,
                       hf_config: dict[str, Any] | None = None, seed: int = 0) -> EngineParts:
    return EngineBuilder(config, executor_factory, hf_config, seed).build()


__all__ = ["IN_MEMORY", "EngineBuilder", "EngineParts", "build_engine_parts", "random_weights", "resolve_dtype"]
