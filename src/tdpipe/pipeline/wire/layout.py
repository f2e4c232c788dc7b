"""The P x T layout of a run: P pipeline stages, each a group of T tensor-parallel ranks (SiPipe's P(i,j), §1;
TD-Pipe §3.2's hierarchy controller as rank 0).

Every rank, group and peer comes from here, so the executor, the stage workers and torchrun agree on one
numbering and nobody does rank arithmetic of their own:

    rank 0                      the engine (control plane: scheduler, block manager, sampler)
    rank 1 + s * T + t          stage s (0..P-1), tensor-parallel rank t (0..T-1)

Activations go from (s, t) to (s + 1, t): after the row-parallel all-reduce every rank of a stage holds the
whole hidden state, so each rank feeds its own counterpart and no rank of the next stage waits on a
broadcast. Results go from the last stage to the engine: logits as one vocabulary shard per rank (the
engine concatenates them, so no [batch, vocab] gather ever runs inside the group), greedy ids from tp rank 0
alone (the group agrees on the argmax with a small all-gather first).
"""
from __future__ import annotations

from dataclasses import dataclass

ENGINE = 0


@dataclass(frozen=True)
class Layout:
    pp: int = 1  # P: pipeline stages
    tp: int = 1  # T: tensor-parallel ranks per stage

    def __post_init__(self) -> None:
        for name, v in (("pipeline_parallel_size", self.pp), ("tensor_parallel_size", self.tp)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    @property
    def num_workers(self) -> int:
        return self.pp * self.tp

    @property
    def world_size(self) -> int:
        """The engine plus P x T workers."""
        return 1 + self.num_workers

    def rank(self, stage: int, tp_rank: int = 0) -> int:
        if not (0 <= stage < self.pp and 0 <= tp_rank < self.tp):
            raise ValueError(f"no worker (stage {stage}, tp rank {tp_rank}) in a {self}")
        return 1 + stage * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, tp rank) of a worker rank."""
        if not 1 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not a worker of a {self} (workers are 1..{self.world_size - 1})")
        return divmod(rank - 1, self.tp)

    def worker_ranks(self) -> list[int]:
        return list(range(1, self.world_size))

    def stage_ranks(self, stage: int) -> list[int]:
        """The tensor-parallel group of a stage, in tp-rank order."""
        return [self.rank(stage, t) for t in range(self.tp)]

    def leaders(self) -> list[int]:
        """tp rank 0 of every stage: the rank that speaks for its stage (traces, greedy results)."""
        return [self.rank(s, 0) for s in range(self.pp)]

    def prev_peer(self, rank: int) -> int | None:
        """Where a worker's activations come from (None: the first stage embeds token ids)."""
        s, t = self.coords(rank)
        return None if s == 0 else self.rank(s - 1, t)

    def next_peer(self, rank: int) -> int | None:
        """Where a worker's output goes: its counterpart in the next stage; on the last stage the engine
        (None for tp ranks > 0 of the last stage when only greedy ids are returned: see result_ranks)."""
        s, t = self.coords(rank)
        return ENGINE if s == self.pp - 1 else self.rank(s + 1, t)

    def result_ranks(self, greedy: bool) -> list[int]:
        """The last stage's ranks that send the engine a micro-batch's result: every rank its logits shard,
        or tp rank 0 alone the greedy ids."""
        last = self.stage_ranks(self.pp - 1)
        return last[:1] if greedy else last

    def is_first(self, rank: int) -> bool:
        return self.coords(rank)[0] == 0

    def is_last(self, rank: int) -> bool:
        return self.coords(rank)[0] == self.pp - 1

    def name(self, rank: int) -> str:
        """How errors and logs name a worker: 'stage 1' with T = 1, 'stage 1 tp rank 0' otherwise."""
        s, t = self.coords(rank)
        return f"stage {s}" if self.tp == 1 else f"stage {s} tp rank {t}"

    def __str__(self) -> str:
        return f"pp {self.pp} x tp {self.tp} layout"


__all__ = ["ENGINE", "Layout"]
