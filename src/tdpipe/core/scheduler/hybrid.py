"""`hybrid` (PP+HB in TD-Pipe §4): Sarathi-Serve's stall-free batching with chunked prefill.

Sarathi-Serve (Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve",
OSDI 2024) gives every micro-batch the same token budget: the decodes that are ready go in first, one token
each, and the rest of the budget is filled with a chunk of prefill, so prompts never stall the decodes and
every pipeline slot carries a similar amount of work. TD-Pipe §4 uses it, under pipeline parallelism, as the
PP+HB (hybrid batching) baseline.

Protocol with the engine (on top of the base one): a sequence in a partial chunk stays RUNNING and gets no
sampled token; the engine appends a token only when `num_computed_tokens == num_tokens` after the step.
So a running sequence is ready to decode when `num_computed_tokens == num_tokens - 1` and is still
prefilling when it has more than one token without KV. KV blocks are allocated chunk by chunk.
"""
from __future__ import annotations

from tdpipe.core.batch import Batch
from tdpipe.core.scheduler.base import Scheduler
from tdpipe.core.scheduler.registry import register_policy
from tdpipe.sequence import Sequence, SequenceStatus


@register_policy(
    "hybrid", default_token_budget=512,
    help="PP+HB, a TD-Pipe §4 baseline (Sarathi-Serve): a fixed token budget per micro-batch, decodes first, "
         "then chunked prefill",
    budget_help="Sarathi-Serve's fixed budget for decodes + prefill chunks")
class HybridScheduler(Scheduler):
    chunks_prefill = True
    # -- budget hooks (the throttle policy overrides these) ---------------------------------------------
    def decode_limit(self) -> int:
        """Most decodes in this micro-batch."""
        return min(self.decode_batch_cap(), self.config.max_num_batched_tokens)

    def prefill_budget(self, num_decodes: int) -> int:
        """Prefill tokens for this micro-batch, given the decodes already in it."""
        return self.config.max_num_batched_tokens - num_decodes

    def schedule(self) -> Batch | None:
        seqs: list[Sequence] = []
        lens: list[int] = []

        # 1. decodes first, one token each, given KV slots (may preempt the newest idle sequences)
        ready, partial = self._idle_by_phase()
        for s in self._reserve_decode_slots(ready[: self.decode_limit()]):
            seqs.append(s)
            lens.append(1)
        num_decodes = len(seqs)
        budget = self.prefill_budget(num_decodes)

        # 2. the rest of the budget: chunks of prompts already started (oldest first), then new ones
        blocked = False
        for seq in partial:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted to make room for an older chunk in this loop
            n = self._fit_chunk(seq, budget, seqs)
            if n == 0:
                blocked = True
                continue  # a later sequence may still have room in its last block
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            seqs.append(seq)
            lens.append(n)
            budget -= n
        if not blocked:
            budget -= self._admit_chunks(budget, seqs, lens)

        if not seqs:
            return None
        for s in seqs:
            s.in_flight = True
        return Batch(self.next_batch_id(), seqs, lens, is_prefill=len(seqs) > num_decodes)

    # -- helpers -------------------------------------------------------------------------------------
    def _idle_by_phase(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences not in flight that decode next, and those still prefilling, in order, in one
        pass (every step walks every running sequence). A prefilling one preempted while the decodes get their
        slots is skipped by its status later."""
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for s in self.running:
            if s.in_flight:
                continue
            left = len(s.prompt_token_ids) + len(s.output_token_ids) - 1 - s.num_computed_tokens
            if left == 0:
                decoding.append(s)
            elif left > 0:
                prefilling.append(s)
        return decoding, prefilling

    @staticmethod
    def _is_decoding(seq: Sequence) -> bool:
        return seq.num_computed_tokens == seq.num_tokens - 1

    @staticmethod
    def _is_prefilling(seq: Sequence) -> bool:
        return seq.num_computed_tokens < seq.num_tokens - 1

    def _prefill_debt(self) -> int:
        """Blocks that the prompts already started still need to finish their prefill."""
        bm = self.bm
        return sum(max(0, bm.blocks_needed(s.num_tokens) - len(s.block_table))
                   for s in self.running if self._is_prefilling(s))

    def _fit_chunk(self, seq: Sequence, budget: int, taken: list[Sequence]) -> int:
        """Size of seq's next chunk: up to `budget` tokens, shrunk to the KV that is free. When not even
        one token fits, preempt newer idle sequences (never older ones: no recompute ping-pong)."""
        bm = self.bm
        want = min(seq.num_tokens - seq.num_computed_tokens, budget)
        while True:
            room = bm.chunk_room(seq)
            if room > 0:
                return min(want, room)
            victim = None
            for s in reversed(self.running):
                if s is seq:
                    break
                if not s.in_flight and s not in taken:
                    victim = s
                    break
            if victim is None:
                return 0
            self._preempt(victim)

    def _admit_chunks(self, budget: int, seqs: list[Sequence], lens: list[int]) -> int:
        """Admit waiting sequences (FCFS) with a first chunk each; returns the tokens used.

        A sequence is admitted only if its whole prompt fits beside what started prompts still need and
        the watermark, so admitted prompts can normally finish their prefill; only the chunk is allocated.
        """
        cfg = self.config
        used = 0
        debt = self._prefill_debt() if self.waiting else 0
        num_seqs = self.num_seqs() if self.waiting else 0
        while self.waiting and budget - used > 0 and num_seqs + self.waiting[0].num_samples_pending <= cfg.max_num_seqs:
            seq = self.waiting[0]
            reserve = debt + (self.watermark_blocks if self.running else 0)
            plan = self.prefill_plan(seq)  # blocks of a cached prefix are mapped, not allocated
            if plan.num_new_blocks + reserve > self.bm.num_free_blocks:
                break
            n = min(seq.num_tokens - plan.num_cached_tokens, budget - used)
            if self.bm.window_pool is not None and not self.window_admits(seq, plan.num_cached_tokens + n):
                break
            self.waiting.popleft()
            self._allocate_prompt(seq, plan.num_cached_tokens + n)
            num_seqs += seq.num_samples_pending
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            debt += self.bm.blocks_needed(seq.num_tokens) - len(seq.block_table)
            seqs.append(seq)
            lens.append(n)
            used += n
        return used
