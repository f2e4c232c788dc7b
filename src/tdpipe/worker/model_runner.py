"""A stage's execution: its layer slice, its slice of the KV cache, and input preparation.

Input preparation turns the small StepInput message into tensors (positions, KV slots, block tables);
the pipeline runtime runs it for micro-batch i+1 while micro-batch i computes (SiPipe §5.2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from tdpipe.config import ModelConfig
from tdpipe.model.llama import AttentionMetadata, LlamaForCausalLM
from tdpipe.model.packed_linear import pack_linears
from tdpipe.model.tensor_parallel import SINGLE, TPGroup
from tdpipe.model.weights import iter_safetensors
from tdpipe.step_input import StepInput


@dataclass
class PreparedInput:
    step: StepInput
    input_ids: torch.Tensor
    meta: AttentionMetadata
    sample_idx: torch.Tensor  # rows of the hidden states whose logits are needed (last token per sequence)


def keep_freed_memory() -> None:
    """glibc returns big freed buffers to the OS and page-faults them back on the next allocation (~0.4 ms
    per MB in this VM: more than the GEMM that fills them). Keep the heap instead (mallopt M_MMAP_MAX=0,
    M_TRIM_THRESHOLD=2 GiB); activations of one step are reused by the next."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)
        libc.mallopt(-1, 0x7FFFFFFF)
    except (OSError, AttributeError):
        pass


def prepare_input(step: StepInput, block_size: int, device: torch.device) -> PreparedInput:
    """StepInput (plain lists) -> tensors: positions, KV slots, block tables, sampled rows."""
    dev = device
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
    max_blocks = max(len(b) for b in step.block_tables)
    bt = torch.tensor([row + [0] * (max_blocks - len(row)) for row in step.block_tables], dtype=torch.int32)
    blk = bt[seq_idx, positions // block_size].to(torch.int64)
    slots = blk * block_size + positions % block_size
    meta = AttentionMetadata(
        positions=positions.to(dev),
        slot_mapping=slots.to(dev),
        block_tables=bt.to(dev),
        cu_seqlens_q=cu.to(torch.int32).to(dev),
        seq_lens=seq_lens.to(torch.int32).to(dev),
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
    return PreparedInput(step, ids, meta, sample_idx.to(dev))


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model_path: str, dtype: torch.dtype, num_blocks: int,
                 block_size: int, start_layer: int = 0, end_layer: int | None = None,
                 device: str = "cpu", tp: TPGroup = SINGLE, head_range: tuple[int, int] | None = None,
                 weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """`tp`: this rank's tensor-parallel group; it then holds its shard of the slice and the KV cache of
        its KV heads (model/tensor_parallel.py). `head_range`: its part of an lm_head split across stages.
        `weights`: (HF name, tensor) pairs in memory instead of model_path's checkpoint (a whole model)."""
        keep_freed_memory()
        self.cfg = model_config
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_size = block_size
        torch.manual_seed(0)  # only matters for tensors the checkpoint fails to cover (an error anyway)
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config, start_layer, end_layer, tp, head_range)
        model = model.to_empty(device=self.device)
        model.rotary.__init__(model_config.head_dim, model_config.max_position_embeddings,
                              model_config.rope_theta, model_config.rope_scaling)  # buffers were on meta
        model.rotary.to(self.device)
        model.load_weights(weights if weights is not None
                           else iter_safetensors(model_path, names=model.wants, slicer=model.shard_of))
        self.model = model.to(dtype).eval()
        pack_linears(self.model)  # bf16 on CPU: weights packed for oneDNN once, not per call
        self.model.rotary.cos_sin = self.model.rotary.cos_sin.float()  # the table stays float32
        n_layers = model.end_layer - model.start_layer
        shape = (n_layers, 2, num_blocks, model.heads.kv_count, block_size, model_config.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)

    # -- input preparation ---------------------------------------------------------------------------
    def prepare(self, step: StepInput) -> PreparedInput:
        return prepare_input(step, self.block_size, self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: the KV of block src into block dst, in every layer of this slice. Runs in the
        compute thread just before the batch that writes dst, so it sees every earlier batch's writes."""
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    # -- compute -------------------------------------------------------------------------------------
    def execute(self, inp: PreparedInput, hidden: torch.Tensor | None = None,
                normed_rows: bool = False) -> torch.Tensor:
        """Run the slice. Returns hidden states [T, H], or on the last stage logits of sampled rows: this
        rank's vocabulary range [S, V_rank] (all of it with T = 1)."""
        if inp.step.block_copies:
            self.copy_blocks(inp.step.block_copies)
        x = inp.input_ids if self.model.is_first else hidden
        h = self.model(x, inp.meta, self.kv_cache)
        if not self.model.is_last:
            return h
        if normed_rows:  # the head split across stages: the sampled rows, normalised, for both parts
            return self.model.final_norm(h[inp.sample_idx])
        return self.model.compute_logits(h[inp.sample_idx])

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """This stage's part of a split lm_head on normalised rows: logits of its vocabulary range."""
        return self.model.head_logits(normed)


    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy ids over the whole vocabulary from execute()'s logits (with T > 1 the group's collective:
        every rank of the last stage calls it)."""
        return self.model.greedy_ids(logits)
