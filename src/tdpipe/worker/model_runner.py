"""A stage's execution: its layer slice, its slice of the KV cache, and input preparation.

Input preparation turns the small StepInput message into tensors (positions, KV slots, block tables);
the pipeline runtime runs it for micro-batch i+1 while micro-batch i computes (SiPipe §5.2). On a platform
with CUDA graphs (and without --enforce-eager) pure-decode steps run as captured graphs, padded to the next
captured batch size (worker/cuda_graph.py); prefills and larger batches run eagerly.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from tdpipe.config import ModelConfig
from tdpipe.model import cpu_ops
from tdpipe.model.jit import in_background
from tdpipe.model.llama import AttentionMetadata, LlamaForCausalLM
from tdpipe.model.kv_quant import cache_layout
from tdpipe.model.paged_attention import load_kernel
from tdpipe.model.quantization import prepare_linears
from tdpipe.model.tensor_parallel import SINGLE, TPGroup
from tdpipe.model.awq import read_checkpoint
from tdpipe.platforms import get_platform
from tdpipe.sampling.device_sampler import DeviceSampler
from tdpipe.step_input import StepInput
from tdpipe.worker.cuda_graph import CudaGraphBackend, DecodeGraphs, GraphBackend, GraphInput, GraphSettings
from tdpipe.worker.kv_transfer import export_blocks, import_blocks, map_staging


@dataclass
class PreparedInput:
    step: StepInput
    input_ids: torch.Tensor | None  # None for a graph step (its inputs sit in a staging buffer)
    meta: AttentionMetadata | None
    sample_idx: torch.Tensor | None  # rows of the hidden states whose logits are needed (last token per sequence)
    graph: GraphInput | None = None  # a decode step staged for a captured graph (worker/cuda_graph.py)


def prepare_input(step: StepInput, block_size: int, device: torch.device) -> PreparedInput:
    """StepInput (plain lists) -> tensors: positions, KV slots, block tables, sampled rows."""
    dev = device
    nb = dev.type != "cpu"  # from pageable memory: staged at once, without waiting for the device's queue
    q = torch.tensor(step.query_lens, dtype=torch.int64)
    seq_lens = torch.tensor(step.seq_lens, dtype=torch.int64)
    s = len(step.query_lens)
    cu = torch.zeros(s + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=cu[1:])
    t = int(cu[-1])
    if not step.is_prefill and all(n == 1 for n in step.query_lens):
        positions = seq_lens - 1
        seq_idx = torch.arange(s)
    else:
        seq_idx = torch.repeat_interleave(torch.arange(s), q)
        positions = torch.arange(t) - cu[:-1][seq_idx] + (seq_lens - q)[seq_idx]
    bt, slots = _tables_and_slots(step.block_tables, seq_idx, positions, block_size)
    meta = AttentionMetadata(
        positions=positions.to(dev, non_blocking=nb),
        slot_mapping=slots.to(dev, non_blocking=nb),
        block_tables=bt.to(dev, non_blocking=nb),
        cu_seqlens_q=cu.to(torch.int32).to(dev, non_blocking=nb),
        seq_lens=seq_lens.to(torch.int32).to(dev, non_blocking=nb),
        fresh=step.fresh,
        cu_seqlens_list=cu.tolist(),
    )
    ids = torch.tensor(step.token_ids, dtype=torch.int64, device=dev)
    if any(step.all_logits):  # prompt_logprobs: every new token's logits for those sequences
        ends = cu.tolist()
        rows: list[int] = []
        for i, a in enumerate(step.all_logits):
            rows.extend(range(ends[i], ends[i + 1]) if a else [ends[i + 1] - 1])
        sample_idx = torch.tensor(rows, dtype=torch.int64)
    else:
        sample_idx = cu[1:] - 1
    if step.local_block_tables:  # sliding-window layers' own pool (core/window_blocks.py)
        meta.local = _local_meta(meta, step.local_block_tables, seq_idx, positions, block_size, dev)
    return PreparedInput(step, ids, meta, sample_idx.to(dev, non_blocking=nb))


def _tables_and_slots(tables: list[list[int]], seq_idx: torch.Tensor, positions: torch.Tensor,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block tables padded to one width (int32 [S, max_blocks]) and each new token's KV slot."""
    width = max(len(b) for b in tables)
    bt = torch.tensor([row + [0] * (width - len(row)) for row in tables], dtype=torch.int32)
    slots = bt[seq_idx, positions // block_size].to(torch.int64) * block_size + positions % block_size
    return bt, slots


def _local_meta(meta: AttentionMetadata, tables: list[list[int]], seq_idx: torch.Tensor, positions: torch.Tensor,
                block_size: int, dev: torch.device) -> AttentionMetadata:
    """The metadata of the sliding-window layers: their own slots and block tables, the rest shared. Entries of
    blocks out of the window are the null block 0, which the window masks."""
    nb = dev.type != "cpu"
    bt, slots = _tables_and_slots(tables, seq_idx, positions, block_size)
    return AttentionMetadata(positions=meta.positions, slot_mapping=slots.to(dev, non_blocking=nb),
                             block_tables=bt.to(dev, non_blocking=nb), cu_seqlens_q=meta.cu_seqlens_q,
                             seq_lens=meta.seq_lens, fresh=meta.fresh, cu_seqlens_list=meta.cu_seqlens_list)


class LayerCaches:
    """A slice's KV caches when its sliding-window layers have a pool of their own: layer i's cache lives in
    the global tensor [Lg, 2, NB, Hkv, bs, D] or the local one [Ll, 2, NBw, ...], indexed as the model indexes
    one [L, 2, ...] tensor."""

    def __init__(self, global_cache: torch.Tensor, local_cache: torch.Tensor, is_local: list[bool]) -> None:
        self.global_cache, self.local_cache = global_cache, local_cache
        self._where: list[tuple[torch.Tensor, int]] = []
        n_local = 0
        for loc in is_local:
            self._where.append((local_cache, n_local) if loc else (global_cache, len(self._where) - n_local))
            n_local += loc

    def __getitem__(self, key: int | tuple[int, int]) -> torch.Tensor:
        """Layer i's [2, NB, Hkv, bs, D] cache (`[i]`), or its K / V cache (`[i, j]`)."""
        if isinstance(key, tuple):
            t, k = self._where[key[0]]
            return t[k, key[1]]
        t, k = self._where[key]
        return t[k]


def _materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialised storage on `device`. Not `Module.to_empty`: its
    meta path runs through torch._refs, which imports sympy: 0.3 s of every stage's start-up."""
    made: dict[int, torch.nn.Parameter] = {}  # a parameter two modules share stays shared
    for mod in module.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.device.type == "meta":
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                     requires_grad=p.requires_grad)
                setattr(mod, name, made[id(p)])
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None and b.device.type == "meta":
                mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model_path: str, dtype: torch.dtype, num_blocks: int,
                 block_size: int, start_layer: int = 0, end_layer: int | None = None,
                 device: str = "cpu", tp: TPGroup = SINGLE, head_range: tuple[int, int] | None = None,
                 weights: Iterable[tuple[str, torch.Tensor]] | None = None, graphs: GraphSettings | None = None,
                 graph_backend: GraphBackend | None = None, num_window_blocks: int = 0) -> None:
        """`tp`: this rank's tensor-parallel group; it then holds its shard of the slice and the KV cache of
        its KV heads (model/tensor_parallel.py). `head_range`: its part of an lm_head split across stages.
        `weights`: (HF name, tensor) pairs in memory instead of model_path's checkpoint (a whole model).
        `graphs`: capture decode graphs of these sizes (worker/cuda_graph.graph_settings; None: eager), through
        `graph_backend` (None: CUDA graphs where the platform has them, else eager; tests inject a fake).
        `num_window_blocks`: the sliding-window layers' own pool (core/window_blocks.py; 0: they use the global
        cache like every layer); such a slice runs eagerly (no decode graphs; the window pool has not yet run
        on a GPU)."""
        self.platform = get_platform(device)
        self.platform.configure_runner()
        self.cfg = model_config
        self.dtype = dtype
        self.device = torch.device(device)
        if self.device.type == "cpu":  # the C++ kernels compile (first run) or load while the weights load
            in_background(cpu_ops.kernel, load_kernel)
        self.block_size = block_size
        self.model_path = model_path
        self._start_path = model_path  # a GGUF's blocks belong to the folder converted from it, no other
        self._slice = (start_layer, end_layer, tp, head_range)
        self.num_global_blocks = num_blocks
        self.num_window_blocks = num_window_blocks
        self.model = self._build_model(weights if weights is not None else model_path)
        self.is_local = [w is not None
                         for w in model_config.layer_windows[self.model.start_layer:self.model.end_layer]]
        if num_window_blocks and any(self.is_local):
            graphs = None  # the window pool runs eagerly
        self._allocate_kv()
        self.kv_staging: torch.Tensor | None = None  # disaggregation's shared KV staging (attach_kv_staging)
        self.sampler = DeviceSampler()
        self.graphs: DecodeGraphs | None = None
        if graph_backend is None and graphs is not None and self.platform.supports_cuda_graphs:
            graph_backend = CudaGraphBackend()
        if self.device.type == "cuda":
            self.warm_up()
        if graphs is not None and graph_backend is not None:
            self.graphs = DecodeGraphs(self._layers, first=self.model.is_first, hidden_size=model_config.hidden_size,
                                       dtype=dtype, device=self.device, block_size=block_size, settings=graphs,
                                       backend=graph_backend, copy_out=not self.model.is_last)
            self.graphs.capture()

    def _build_model(self, source: str | Iterable[tuple[str, torch.Tensor]]) -> LlamaForCausalLM:
        """This slice's model with weights from a checkpoint folder or (HF name, tensor) pairs, cast to the
        run's dtype, its linears prepared (--quantization) and its rope tables built on the device."""
        start, end, tp, head_range = self._slice
        torch.manual_seed(0)  # only matters for tensors the checkpoint fails to cover (an error anyway)
        with torch.device("meta"):
            model = LlamaForCausalLM(self.cfg, start, end, tp, head_range)
        _materialize(model, self.device)
        model.load_weights(read_checkpoint(source, names=model.wants, slicer=model.shard_of)
                           if isinstance(source, str) else source)
        model = model.to(self.dtype).eval()
        # w8a8, gguf, awq, or bf16 packed; new weights (update_weights) in another folder or in memory are
        # quantised from their floats: the GGUF file's blocks are the old weights
        gguf = self.cfg.gguf_file if source == self._start_path else ""
        prepare_linears(model, self.cfg.quantization, gguf, source if isinstance(source, str) else "")
        model.init_rotary(self.device)  # float32 rope tables, built on the device (they were on meta)
        return model

    def _allocate_kv(self) -> None:
        """The slice's KV cache, zeroed: one tensor, or the global and sliding-window pools."""
        model, cfg = self.model, self.cfg
        n_layers = model.end_layer - model.start_layer
        dtype, width = cache_layout(cfg.kv_cache_dtype, self.dtype, cfg.head_dim)  # int8: rows and their scales
        block = (model.heads.kv_count, self.block_size, width)
        self.local_cache: torch.Tensor | None = None
        if self.num_window_blocks and any(self.is_local):
            n_loc = sum(self.is_local)
            glob = self.platform.kv_zeros((n_layers - n_loc, 2, self.num_global_blocks, *block), dtype,
                                          self.device)
            self.local_cache = self.platform.kv_zeros((n_loc, 2, self.num_window_blocks, *block), dtype,
                                                      self.device)
            self.kv_cache: torch.Tensor | LayerCaches | None = LayerCaches(glob, self.local_cache, self.is_local)
        else:
            self.kv_cache = self.platform.kv_zeros((n_layers, 2, self.num_global_blocks, *block), dtype,
                                                   self.device)

    # -- weights and memory between steps (collective_rpc; core/weight_sync.py) ------------------------------
    def update_weights(self, source: str | Iterable[tuple[str, torch.Tensor]]) -> None:
        """New weights for this slice from a checkpoint folder or (HF name, tensor) pairs, the KV cache kept
        (the engine drops every cached prefix); later loads after sleep(2) read the folder again."""
        self.model = None  # the old weights go before the new ones load: peak memory is one model
        try:
            self.model = self._build_model(source)
        except Exception:
            if os.path.isdir(self.model_path):  # a failed load leaves no weights: reload the last folder's
                self.model = self._build_model(self.model_path)
            raise
        if isinstance(source, str):
            self.model_path = source
        if self.graphs is not None and self.kv_cache is not None:  # else wake_up(["kv_cache"]) captures
            self.graphs.capture()  # the captured graphs read the old parameters

    def sleep(self, level: int) -> None:
        """level 1: free the KV cache; level 2: the weights too (wake_up reloads them from the last folder)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if level == 2 and not os.path.isdir(self.model_path):
            raise ValueError("sleep(level=2) drops the weights, and wake_up() reloads them from the checkpoint "
                             "folder; this engine's weights came from memory: use level 1, or update_weights(FOLDER)")
        self.kv_cache = self.local_cache = None
        if level == 2:
            self.model = None
        gc.collect()
        self.platform.empty_cache()

    def wake_up(self, parts: list[str] | None = None) -> None:
        """Undo sleep() for `parts` ("weights", "kv_cache"; None: both): the weights (if dropped) from the
        last checkpoint folder, a zeroed KV cache. The decode graphs are captured once both are back."""
        parts = ["weights", "kv_cache"] if parts is None else parts
        if "weights" in parts and self.model is None:
            self.model = self._build_model(self.model_path)
        if "kv_cache" in parts and self.kv_cache is None:
            self._allocate_kv()
        if self.graphs is not None and self.model is not None and self.kv_cache is not None:
            self.graphs.capture()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Three dummy steps through the slice, writing nothing to the KV cache (every slot -1): a prefill, a
        mixed step (a few rows each) and a short eager decode, the attention kernels' three compiled variants.
        Compiled Triton builds a kernel on its first launch (about a second each), which the decode graphs'
        capture does for their steps; without this the first prompts of a server or a benchmark would wait
        for the eager ones. A slice with a sliding-window pool of its own skips it (that pool runs eagerly)."""
        if self.local_cache is not None:
            return
        bs = self.block_size
        for query, seqs, prefill in (([bs + 1, 2], [bs + 1, 2], True), ([2, 1, 1, 1], [3, 2, 2, 2], False),
                                     ([1, 1], [2, 2], False)):
            step = StepInput(-1, [0] * sum(query), query, seqs, [[0] * -(-n // bs) for n in seqs], prefill)
            inp = prepare_input(step, bs, self.device)
            inp.meta.slot_mapping.fill_(-1)
            x = inp.input_ids if self.model.is_first else \
                torch.zeros(sum(query), self.cfg.hidden_size, dtype=self.dtype, device=self.device)
            self.model(x, inp.meta, self.kv_cache)

    def _layers(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The slice's layers on token ids (first stage) or hidden states: what a decode graph captures."""
        return self.model(x, meta, self.kv_cache)

    # -- input preparation ---------------------------------------------------------------------------
    def prepare(self, step: StepInput) -> PreparedInput:
        """Tensors for an eager step, or a pure-decode step staged for its captured graph."""
        if self.graphs is not None and (size := self.graphs.size_for(step)) is not None:
            return PreparedInput(step, None, None, None, self.graphs.stage(step, size))
        return prepare_input(step, self.block_size, self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: the KV of block src into block dst, in every layer of this slice. Runs in the
        compute thread just before the batch that writes dst, so it sees every earlier batch's writes."""
        ng = self.num_global_blocks  # local blocks are numbered past the global pool (block_manager.py)
        glob = [c for c in copies if c[0] < ng]
        if self.local_cache is None:  # no sliding layer in this slice: the local pool's copies are not its own
            if glob:
                self._copy(self.kv_cache, glob)
            return
        for cache, pairs in ((self.kv_cache.global_cache, glob),
                             (self.local_cache, [(a - ng, b - ng) for a, b in copies if a >= ng])):
            if pairs:
                self._copy(cache, pairs)

    def _copy(self, cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """cache[:, :, dst] = cache[:, :, src] for every (src, dst) pair, in one indexed copy."""
        src = torch.tensor([c[0] for c in pairs], device=self.device)
        dst = torch.tensor([c[1] for c in pairs], device=self.device)
        cache[:, :, dst] = cache[:, :, src]

    # -- prefill/decode disaggregation (worker/kv_transfer.py) ------------------------------------------
    def attach_kv_staging(self, path: str, shape: tuple[int, ...]) -> None:
        """Map the shared KV staging area the engine created (collective_rpc, before the first step)."""
        if not isinstance(self.kv_cache, torch.Tensor):
            raise ValueError("KV transfer needs one KV tensor (no sliding-window pool)")
        self.kv_staging = map_staging(path, shape, self.kv_cache.dtype)

    def _staging(self) -> torch.Tensor:
        if self.kv_staging is None:
            raise RuntimeError("a step carries KV transfers but no staging area was attached")
        return self.kv_staging

    def kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these KV blocks, [layers, 2, len(ids), Hkv, bs, D] on the host: for checking a transfer."""
        return self.kv_cache[:, :, block_ids].cpu().clone()

    # -- compute -------------------------------------------------------------------------------------
    def execute(self, inp: PreparedInput, hidden: torch.Tensor | None = None,
                normed_rows: bool = False) -> torch.Tensor:
        """Run the slice. Returns hidden states [T, H], or on the last stage logits of sampled rows: this
        rank's vocabulary range [S, V_rank] (all of it with T = 1)."""
        if inp.step.block_copies:
            self.copy_blocks(inp.step.block_copies)
        if inp.step.kv_import:  # disaggregation: a prompt's KV arrived from a prefill instance
            import_blocks(self.kv_cache, self._staging(), inp.step.kv_import, self.model.start_layer)
        if inp.graph is not None:  # a decode: every row is sampled
            h = rows = self.graphs.run(inp.graph, hidden)
        else:
            x = inp.input_ids if self.model.is_first else hidden
            h = self.model(x, inp.meta, self.kv_cache)
            rows = None if not self.model.is_last else h[inp.sample_idx]
        if inp.step.kv_export:  # disaggregation: the finished prompts' KV, for a decode instance
            export_blocks(self.kv_cache, self._staging(), inp.step.kv_export, self.model.start_layer)
        if not self.model.is_last:
            return h
        if normed_rows:  # the head split across stages: the sampled rows, normalised, for both parts
            return self.model.final_norm(rows)
        return self.model.compute_logits(rows)

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """This stage's part of a split lm_head on normalised rows: logits of its vocabulary range."""
        return self.model.head_logits(normed)


    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy ids over the whole vocabulary from execute()'s logits (with T > 1 the group's collective:
        every rank of the last stage calls it)."""
        return self.model.greedy_ids(logits)

    def sample(self, logits: torch.Tensor, temperatures: list[float], seed: int, salt: int = 0) -> torch.Tensor:
        """greedy() of logits perturbed for the rows with a temperature (sampling/device_sampler.py): each row's
        token, sampled on this device. `salt`: this rank's, so vocabulary shards draw independent noise."""
        return self.model.greedy_ids(self.sampler.perturb(logits, temperatures, seed, salt))
