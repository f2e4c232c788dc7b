"""How the KV budget is split between the global layers' pool and the sliding-window layers' pool.

Without local layers: one pool, budget // (bytes of a block over all layers), as always. With them (vLLM's
hybrid KV cache): a sequence of L tokens holds ceil(L / bs) global blocks but at most ceil(W / bs) + 1 local
ones between steps (core/window_blocks.py). The local pool gets what max_num_seqs sequences at a full window
need plus the largest prefill step (a whole max_model_len prompt for policies that prefill whole; a budget
chunk and the window before it for chunked prefill), so it never limits the batch, and every other byte
goes to the global pool, which then holds more tokens than all-global layers would. A budget where that
local pool would outgrow the global one falls back to equal pools: the same blocks as all-global layers
(nothing saved, nothing lost). All-local models (Mistral with sliding_window): the whole budget is the local
pool, and the global table only counts positions (no memory behind it).
"""
from __future__ import annotations

from dataclasses import dataclass

from tdpipe.config import ModelConfig

MAX_LOGICAL_BLOCKS = 1 << 20  # cap of the global table's count when no layer stores KV in it


@dataclass(frozen=True)
class KVPools:
    num_blocks: int  # global pool: blocks of the page table (every layer's when there are no local layers)
    num_window_blocks: int = 0  # local pool, block 0 (the null block) included; 0: no local pool
    window: int | None = None  # W of the local pool; None: none
    capacity_tokens: int = 0  # the longest sequence the pools hold (max_model_len is lowered to it)


def layer_block_bytes(cfg: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one block in one layer (K and V)."""
    return 2 * cfg.num_kv_heads * cfg.kv_row_bytes(dtype_bytes) * block_size


def size_kv_pools(cfg: ModelConfig, budget: int, block_size: int, dtype_bytes: int, max_model_len: int,
                  max_step_tokens: int, max_num_seqs: int, window_pool: bool = True) -> KVPools:
    """The pools `budget` bytes hold. `max_step_tokens`: the most prompt tokens one sequence prefills in one
    step (max_model_len unless the policy chunks). `window_pool` False: local layers keep all their blocks in
    the global table (pp > 1), sized as today."""
    per_layer = layer_block_bytes(cfg, block_size, dtype_bytes)
    n_local = sum(1 for w in cfg.layer_windows if w is not None) if window_pool else 0
    n_global = cfg.num_layers - n_local
    if n_local == 0:
        nb = budget // (per_layer * cfg.num_layers)
        return KVPools(nb, capacity_tokens=nb * block_size)
    w = cfg.sliding_window
    assert w is not None
    bg, bl = n_global * per_layer, n_local * per_layer
    g = -(-max_model_len // block_size)  # a full-length sequence's global blocks
    per_seq = -(-w // block_size) + 1  # ... and its local ones between steps
    if per_seq >= g:  # the window spans every sequence: nothing to free, one pool as without local layers
        return size_kv_pools(cfg, budget, block_size, dtype_bytes, max_model_len, max_step_tokens, max_num_seqs,
                             window_pool=False)
    step = min(g, -(-(min(max_step_tokens, max_model_len) + w - 1) // block_size) + 1)  # largest step's local
    if n_global == 0:
        nl = budget // bl
        # the largest step must fit in the local pool (whole prompts: the sequence itself), else shorter ones
        cap = max_model_len if nl - 1 >= step else max(0, nl - 1) * block_size
        ng = min(MAX_LOGICAL_BLOCKS, max(1, max_num_seqs * g))
        return KVPools(ng, nl, w, min(cap, ng * block_size))
    nl = 1 + step + max_num_seqs * per_seq  # the null block, one prefill step, a window per sequence
    ng = (budget - nl * bl) // bg
    if ng < nl - 1:  # equal pools: the local one never the tighter (a sequence's local blocks <= its global)
        ng = (budget - bl) // (bg + bl)
        nl = ng + 1
    return KVPools(ng, nl, w, ng * block_size)


__all__ = ["KVPools", "MAX_LOGICAL_BLOCKS", "layer_block_bytes", "size_kv_pools"]
