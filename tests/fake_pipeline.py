"""A fake pipelined executor with deterministic step costs, for driving the real engine loop without a model.

Time is simulated: a micro-batch holds each of the pp stages for `step_cost(step)` seconds, in stage order; a
stage starts it once the previous stage is done with it and it is free. Every row's next token is FILL (the
last stage's argmax of a greedy batch, or a one-hot row of logits). The engine (LLMEngine.from_config with
an in-memory model config and this executor) runs the loop as it runs any executor; `watch` checks the
scheduler's invariants on every batch it forms.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from tdpipe.core.batch import StepInput
from tdpipe.executor.base import Executor, StepResult
from tdpipe.sequence import Sequence, SequenceStatus

FILL = 7  # every sampled token (not an eos id of TINY)
VOCAB = 32
# a tiny Llama shape: nothing is computed with it, the executor is fake (layers: up to 4 stages)
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 1 << 16, "eos_token_id": 0}


def draw_kv_workload(draw, max_requests: int, max_output: int) -> tuple[int, int, list[tuple[int, int]]]:
    """(block_size, num_blocks, [(prompt, output) tokens] of up to `max_requests` requests), each request
    fitting the KV cache alone: the drawn part of the engine-loop property tests' scenarios."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_blocks = draw(st.integers(8, 96))
    cap = num_blocks * block_size
    lengths = []
    for _ in range(draw(st.integers(1, max_requests))):
        p = draw(st.integers(1, max(1, cap // 2)))
        lengths.append((p, draw(st.integers(1, max(1, min(max_output, cap - p))))))
    return block_size, num_blocks, lengths


def step_cost(step: StepInput) -> float:
    """Deterministic: a fixed overhead, plus per decode row, plus per prefill token."""
    prefill, decode = step.shape()
    return 1.0 + 0.05 * decode + 0.01 * prefill


class TimedFakeExecutor(Executor):
    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.clock = self.start = 0.0
        self.stage_free = [0.0] * num_stages
        self.busy = [0.0] * num_stages
        self._done: deque[tuple[float, StepResult]] = deque()

    def now(self) -> float:
        return self.clock

    def submit(self, step: StepInput) -> None:
        t, cost = self.clock, step_cost(step)
        for k in range(self.num_stages):
            t = self.stage_free[k] = max(t, self.stage_free[k]) + cost
            self.busy[k] += cost
        rows = step.logit_rows()
        if step.greedy_rows and all(step.greedy_rows):
            result = StepResult(step.batch_id, token_ids=[FILL] * rows)
        else:
            logits = torch.full((rows, VOCAB), -10.0)
            logits[:, FILL] = 10.0
            result = StepResult(step.batch_id, logits=logits)
        self._done.append((t, result))

    def collect(self) -> StepResult:
        done, result = self._done.popleft()
        self.clock = max(self.clock, done)
        return result

    def drain(self) -> None:
        self._done.clear()

    def reset(self) -> None:
        """Count from now (after the engine's start-up profile, which ran steps here too)."""
        self.start, self.busy = self.clock, [0.0] * self.num_stages

    def bubble_ratio(self) -> float:
        span = self.clock - self.start
        return 1.0 - sum(self.busy) / (len(self.busy) * span) if span else 0.0


@dataclass
class Watch:
    """What the scheduler did, batch by batch."""

    first_admission: list[int] = field(default_factory=list)  # seq ids in the order they first got KV
    batches: int = 0
    max_used_blocks: int = 0


def check_batch(sched, bm, batch, in_flight_ids: set[int]) -> None:
    cfg = sched.config
    assert batch.seqs and len(batch.seqs) == len(batch.num_new_tokens)
    ids = [s.seq_id for s in batch.seqs]
    assert len(ids) == len(set(ids)), "a sequence twice in one batch"
    assert not (set(ids) & in_flight_ids), "a sequence scheduled while in flight"
    if batch.num_tokens > cfg.max_num_batched_tokens:  # only a lone whole prompt of a never-chunking policy
        assert cfg.policy in ("separate", "td-pipe", "vllm-pp") and batch.is_prefill and len(batch.seqs) == 1
    assert len(batch.seqs) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        assert s.status is SequenceStatus.RUNNING and s in sched.running and s.in_flight
        assert n >= 1 and s.num_computed_tokens + n <= s.num_tokens
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens + n, "KV not allocated"
    held = [b for s in sched.running for b in s.block_table]
    assert len(held) == len(set(held)) == bm.num_used_blocks, "page table inconsistent"
    assert bm.num_used_blocks <= bm.num_blocks, "KV past capacity"


def watch(engine) -> Watch:
    """Check every batch the engine's scheduler forms (check_batch) and record admissions."""
    sched, bm, w = engine.scheduler, engine.block_manager, Watch()
    schedule = sched.schedule

    def checked():
        in_flight = {s.seq_id for b in engine._inflight for s in b.seqs}
        batch = schedule()
        if batch is not None:
            check_batch(sched, bm, batch, in_flight)
            w.batches += 1
            w.max_used_blocks = max(w.max_used_blocks, bm.num_used_blocks)
            seen = set(w.first_admission)
            w.first_admission += [s.seq_id for s in sched.running if s.seq_id not in seen]
        return batch

    sched.schedule = checked
    return w


def check_outcome(w: Watch, finished: list[Sequence], seqs: list[Sequence], bm) -> None:
    """Every request finished exactly once with its full output, the cache is empty, first admissions
    followed arrival order (FIFO: no request is overtaken, so none starves)."""
    ids = [s.seq_id for s in finished]
    assert sorted(ids) == sorted(s.seq_id for s in seqs) and len(ids) == len(set(ids))
    assert all(s.num_output_tokens == s.max_tokens for s in seqs)
    assert bm.num_used_blocks == 0
    bm.check_no_leaks()
    assert w.first_admission == sorted(w.first_admission), "a later request was admitted first"
