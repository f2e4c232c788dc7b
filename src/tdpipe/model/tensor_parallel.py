"""Megatron-style tensor parallelism inside a pipeline stage: who holds which heads, rows and vocabulary
entries, and the group's collectives.

A stage of T ranks splits every decoder layer so that each layer needs exactly two all-reduces (Megatron-LM;
TD-Pipe §2 Fig. 6 is the time they cost):
  q/k/v and gate/up   column-parallel: rank t computes its own heads / its own slice of the MLP's rows
  o_proj and down     row-parallel: each rank multiplies its slice, the partial sums are all-reduced
  embedding, lm_head  vocabulary-parallel: rank t holds the rows of its vocabulary range; the embedding's
                      lookups outside it are zero before the all-reduce, and the lm_head's logits stay sharded
                      (the engine concatenates them, or the group agrees on the argmax with a [S, 2] gather)
The KV cache is split by KV heads under the engine's one page table (same block ids on every rank).

Uneven sizes split as evenly as possible (the first ranks take one more): SmolLM2's 3 KV heads over T = 2
give 2 + 1 (its 9 query heads follow their KV groups: 6 + 3). With T above the KV heads each KV head is
replicated on T / KV ranks that split its query heads (vLLM's rule: T a multiple of the KV heads and a
divisor of the query heads, else refused at start with the sizes): Gemma 3 270M's one KV head at T = 2.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def shard_range(n: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's share of n items over tp ranks, the first n % tp ranks one larger."""
    base, extra = divmod(n, tp)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_split(num_heads: int, num_kv_heads: int, tp: int) -> list[HeadShard]:
    """Each rank's query and KV heads: KV heads split evenly, query heads follow their GQA group. With more
    ranks than KV heads (Gemma 3 270M's one at tp = 2), each KV head is replicated on tp / num_kv_heads ranks,
    which split its group's query heads, as vLLM does: a rank holds one KV head, its cache too."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a whole number of groups of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if tp > num_kv_heads:
        if tp % num_kv_heads or num_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} cannot share {num_kv_heads} KV heads ({num_heads} query "
                             f"heads): with more ranks than KV heads, tp must be a multiple of the KV heads and "
                             f"divide the query heads")
        per, copies = num_heads // tp, tp // num_kv_heads
        return [HeadShard(t * per, per, t // copies, 1) for t in range(tp)]
    out = []
    for t in range(tp):
        a, b = shard_range(num_kv_heads, tp, t)
        out.append(HeadShard(a * group, (b - a) * group, a, b - a))
    return out


class TPGroup:
    """A stage's tensor-parallel group. This base class is the size-1 group: every collective a no-op."""

    rank: int = 0
    size: int = 1

    def __init__(self) -> None:
        self.comm_seconds = 0.0  # wall time inside collectives, for the trace (TD-Pipe Fig. 6's split)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the group, in place."""
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's t concatenated along dim (sizes along dim may differ: uneven shards)."""
        return t


SINGLE = TPGroup()


class ProcessGroupTP(TPGroup):
    """Collectives over a ProcessGroup object built for the stage's T ranks (pipeline/wire/groups.py builds it
    without a default group): gloo, or NCCL where the stage's ranks have a GPU each. bfloat16 is reduced in
    float32 and copied back: a bf16 ring sum rounds at every hop, and float32 on T = 2 ranks gives the same
    sum as the unsharded matmul's float32 accumulation up to one final rounding. gloo reduces host memory:
    device tensors (ranks sharing a GPU) go through the host and back (tensor parallelism on CUDA, NCCL or
    gloo, has not yet run on a GPU)."""

    def __init__(self, pg: torch.distributed.ProcessGroup, rank: int, size: int) -> None:
        super().__init__()
        self.pg, self.rank, self.size = pg, rank, size
        self.host_only = pg.name() == "gloo"  # device tensors are staged through host memory

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if self.host_only and not t.is_cpu else t

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        buf = self._host(t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous())
        self.pg.allreduce([buf]).wait()
        if buf is not t:
            t.copy_(buf)
        self.comm_seconds += time.perf_counter() - t0
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        t0 = time.perf_counter()
        device = t.device
        t = self._host(t)
        dim = dim % t.dim()
        n = torch.tensor([t.shape[dim]], dtype=torch.int64, device=t.device)
        sizes = [torch.empty_like(n) for _ in range(self.size)]
        self.pg.allgather([sizes], [n]).wait()
        sizes = [int(s) for s in sizes]
        m = max(sizes)
        if t.shape[dim] < m:  # gloo gathers equal sizes: pad to the largest shard, trim after
            pad = list(t.shape)
            pad[dim] = m - t.shape[dim]
            t = torch.cat([t, t.new_zeros(pad)], dim=dim)
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([outs], [t]).wait()
        res = torch.cat([o.narrow(dim, 0, s) for o, s in zip(outs, sizes)], dim=dim).to(device)
        self.comm_seconds += time.perf_counter() - t0
        return res


GlooTPGroup = ProcessGroupTP  # the former name, until pipeline/stage_worker.py imports ProcessGroupTP


def greedy_ids(local_logits: torch.Tensor, vocab_start: int, tp: TPGroup) -> torch.Tensor:
    """The argmax over the whole vocabulary of vocabulary-sharded logits [S, V_rank], without gathering them:
    each rank's (max, index) pair is gathered ([S, 2] per rank) and the best taken; on equal maxima the lower
    id wins, as torch.argmax over the full row does (lower ranks hold lower ids)."""
    from tdpipe.model import cpu_ops as ops

    idx = ops.argmax(local_logits).to(torch.int64)
    if tp.size == 1:
        return idx + vocab_start
    val = local_logits.gather(1, idx[:, None]).squeeze(1).to(torch.float64)
    pairs = torch.stack([val, (idx + vocab_start).to(torch.float64)], dim=1)  # ids < 2^53: exact
    allp = tp.all_gather(pairs, dim=1).view(len(idx), tp.size, 2)
    best = allp[:, :, 0].argmax(dim=1)  # first maximum: the lowest rank, so the lowest id
    return allp[torch.arange(len(idx)), best, 1].to(torch.int64)


__all__ = ["SINGLE", "GlooTPGroup", "HeadShard", "ProcessGroupTP", "TPGroup", "greedy_ids", "head_split", "shard_range"]
