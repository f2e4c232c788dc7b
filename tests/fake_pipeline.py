"""A fake pipelined executor with deterministic step costs, driving any scheduler without a model.

Time is simulated: a micro-batch holds each of the pp stages for `cost(batch)` seconds, in stage order; a
stage starts it once the previous stage is done with it and it is free. The loop is the engine's: keep up
to pp micro-batches in flight, complete the oldest (a token for every row of batch.sampled_rows()) and hand
it to the scheduler's update_from_output, as the engine does. Invariants are checked on every batch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tdpipe.sequence import Sequence, SequenceStatus


def step_cost(batch) -> float:
    """Deterministic: a fixed overhead, plus per decode row, plus per prefill token."""
    decode = sum(1 for s, n in zip(batch.seqs, batch.num_new_tokens) if n == 1 and s.num_computed_tokens > 0)
    return 1.0 + 0.05 * decode + 0.01 * (batch.num_tokens - decode)


@dataclass
class RunLog:
    finished: list[Sequence] = field(default_factory=list)
    first_admission: list[int] = field(default_factory=list)  # seq ids in the order they first got KV
    steps: int = 0
    clock: float = 0.0
    busy: list[float] = field(default_factory=list)
    max_used_blocks: int = 0

    def bubble_ratio(self) -> float:
        return 1.0 - sum(self.busy) / (len(self.busy) * self.clock) if self.clock else 0.0


def check_batch(sched, bm, batch, in_flight_ids: set[int]) -> None:
    cfg = sched.config
    assert batch.seqs and len(batch.seqs) == len(batch.num_new_tokens)
    ids = [s.seq_id for s in batch.seqs]
    assert len(ids) == len(set(ids)), "a sequence twice in one batch"
    assert not (set(ids) & in_flight_ids), "a sequence scheduled while in flight"
    if batch.num_tokens > cfg.max_num_batched_tokens:  # only a lone whole prompt of a never-chunking policy
        assert cfg.policy in ("separate", "td-pipe") and batch.is_prefill and len(batch.seqs) == 1
    assert len(batch.seqs) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        assert s.status is SequenceStatus.RUNNING and s in sched.running and s.in_flight
        assert n >= 1 and s.num_computed_tokens + n <= s.num_tokens
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens + n, "KV not allocated"
    held = [b for s in sched.running for b in s.block_table]
    assert len(held) == len(set(held)) == bm.num_used_blocks, "page table inconsistent"
    assert bm.num_used_blocks <= bm.num_blocks, "KV past capacity"


def run(sched, bm, seqs: list[Sequence], arrivals: list[float], pp: int, max_steps: int = 500_000) -> RunLog:
    """Requests arrive at the given (sorted) times; returns what happened."""
    log = RunLog(busy=[0.0] * pp)
    pending = deque(zip(arrivals, seqs))
    stage_free = [0.0] * pp
    in_flight: deque = deque()
    admitted: set[int] = set()
    while pending or in_flight or sched.has_unfinished():
        log.steps += 1
        assert log.steps < max_steps, "no progress"
        while pending and pending[0][0] <= log.clock:
            sched.add(pending.popleft()[1])
        while len(in_flight) < pp:
            ids = {s.seq_id for b, _ in in_flight for s in b.seqs}
            batch = sched.schedule()
            if batch is None:
                break
            check_batch(sched, bm, batch, ids)
            for s in sched.running:
                if s.seq_id not in admitted:
                    admitted.add(s.seq_id)
                    log.first_admission.append(s.seq_id)
            log.max_used_blocks = max(log.max_used_blocks, bm.num_used_blocks)
            t, cost = log.clock, step_cost(batch)
            for k in range(pp):
                start = max(t, stage_free[k])
                stage_free[k] = t = start + cost
                log.busy[k] += cost
            in_flight.append((batch, t))
        if not in_flight:
            assert pending, "stalled: nothing in flight, nothing arriving, requests unfinished"
            log.clock = max(log.clock, pending[0][0])
            continue
        batch, done = in_flight.popleft()
        log.clock = max(log.clock, done)
        log.finished += sched.update_from_output(batch, [7] * len(batch.sampled_rows()))
    return log


def check_outcome(log: RunLog, seqs: list[Sequence], bm) -> None:
    """Every request finished exactly once with its full output, the cache is empty, first admissions
    followed arrival order (FIFO: no request is overtaken, so none starves)."""
    ids = [s.seq_id for s in log.finished]
    assert sorted(ids) == sorted(s.seq_id for s in seqs) and len(ids) == len(set(ids))
    assert all(s.num_output_tokens == s.max_tokens for s in seqs)
    assert bm.num_used_blocks == 0
    bm.check_no_leaks()
    assert log.first_admission == sorted(log.first_admission), "a later request was admitted first"
