"""`separate` (PP+SB in TD-Pipe §4): prefill and decode batches never mixed, prefill first (as vLLM v0)."""
from __future__ import annotations

from tdpipe.core.batch import Batch
from tdpipe.core.scheduler.base import Scheduler
from tdpipe.core.scheduler.registry import register_policy


@register_policy(
    "separate", default_token_budget=8192,  # vLLM's default budget
    help="PP+SB, a TD-Pipe §4 baseline (vLLM v0): prefill and decode batches never mixed, prefill first",
    budget_help="most prompt tokens in a prefill batch, a longer prompt runs alone")
class SeparateScheduler(Scheduler):
    def schedule(self) -> Batch | None:
        prefill = self._schedule_prefill()
        if prefill is not None:
            return prefill
        return self._schedule_decode()

    # -- hooks for policies built on whole-prompt prefill batches (td-pipe) --------------------------------
    def prefill_closed(self, seq) -> bool:
        """Stop adding prompts to the prefill batch being formed (seq: the next candidate)."""
        return False

    def on_prefill_admit(self, seq) -> None:
        """A prompt joined the prefill batch being formed."""

    def _schedule_prefill(self) -> Batch | None:
        if not self.waiting:  # most steps of a long run: no walk of the running set for its count
            return None
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        seqs, lens = [], []
        num_seqs = self.num_seqs()
        while self.waiting and num_seqs + self.waiting[0].num_samples_pending <= cfg.max_num_seqs:
            seq = self.waiting[0]
            plan = self.prefill_plan(seq)  # a cached prefix is neither prefilled nor allocated again
            n = seq.num_tokens - plan.num_cached_tokens
            # a lone prompt may exceed the budget: these policies never chunk, so it would wait forever
            if (n > budget and seqs) or self.prefill_closed(seq):
                break
            if plan.num_new_blocks + (self.watermark_blocks if self.running or seqs else 0) > self.bm.num_free_blocks:
                break
            if self.bm.window_pool is not None and not self.window_admits(seq, seq.num_tokens):
                break
            self.waiting.popleft()
            self._admit(seq)
            self.on_prefill_admit(seq)
            seqs.append(seq)
            lens.append(seq.num_tokens - seq.num_computed_tokens)
            num_seqs += seq.num_samples_pending
            budget -= lens[-1]
        if not seqs:
            return None
        for s in seqs:
            s.in_flight = True
        return Batch(self.next_batch_id(), seqs, lens, is_prefill=True)

    def _schedule_decode(self) -> Batch | None:
        ready = [s for s in self.running if not s.in_flight]
        chosen = self._reserve_decode_slots(ready[: self.decode_batch_cap()])
        if not chosen:
            return None
        for s in chosen:
            s.in_flight = True
        return Batch(self.next_batch_id(), chosen, [1] * len(chosen), is_prefill=False)
