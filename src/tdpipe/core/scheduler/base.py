"""The policy interface: the scheduler never knows what runs its batches (docs/design.md)."""
from __future__ import annotations

import itertools
from collections import deque
from typing import Iterable

from tdpipe.config import SchedulerConfig
from tdpipe.core.batch import Batch
from tdpipe.core.block_manager import BlockManager, PrefixPlan
from tdpipe.sequence import Sequence, SequenceStatus


class Scheduler:
    """Owns the waiting and running queues; subclasses decide which sequences form the next micro-batch.

    Protocol with the engine: `schedule()` returns a Batch (or None when nothing can run now); the engine
    runs it, samples a token for each of `batch.sampled_rows()`, and hands them to `update_from_output`,
    which advances the sequences, finishes those that stop, frees their blocks and returns them.
    Sequences in a batch that has not returned are `in_flight` and are never scheduled twice.
    """

    chunks_prefill = False  # whether a prompt is prefilled in chunks of the token budget (KV pool sizing)

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: Iterable[int] = ()) -> None:
        if config.pipeline_depth is None:  # no pipeline given (the engine builder sets it from pp): one batch
            config.pipeline_depth = 1
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)  # the model's end-of-sequence ids
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.block_copies: list[tuple[int, int]] = []  # copy-on-write of the batch being formed
        # admission keeps ~1% of blocks free so fresh prefills do not immediately force preemption
        self.watermark_blocks = max(1, int(0.01 * block_manager.num_blocks)) if block_manager.num_blocks > 100 else 0

    # -- queues ------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def block_managers(self) -> list[BlockManager]:
        """Every page table this scheduler allocates from (one; a disaggregated engine's has one per instance)."""
        return [self.bm]

    def next_batch_id(self) -> int:
        return next(self._ids)

    # -- policy hooks --------------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        raise NotImplementedError

    def update_from_output(self, batch: Batch, token_ids: list[int]) -> list[Sequence]:
        """`batch` ran and `token_ids[j]` was sampled for row `batch.sampled_rows()[j]`: the KV of every row
        advances (full blocks are named for the prefix cache), each sampled row gets its token, a row that
        hits an end-of-sequence id, a stop token id, max_tokens or max_model_len finishes (stop strings are
        the frontend's: it aborts such a request). The other samples of an n > 1 request whose prompt just
        finished come from its group (core/sample_group.py), each with its own first token; they share the
        parent's blocks (fork). Returns the sequences finished now (forked ones included); their blocks are
        already free."""
        rows = batch.sampled_rows()
        if len(rows) != len(token_ids):
            raise ValueError(f"batch {batch.batch_id}: {len(token_ids)} tokens for {len(rows)} sampled rows")
        caching = self.bm.enable_prefix_caching
        window = self.bm.window_pool is not None
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if caching and seq.block_table:
                self.bm.commit_full_blocks(seq)
            if window:  # local blocks out of the next query's window go back to their pool
                self.bm.trim_window(seq)
        finished = []
        for i, tok in zip(rows, token_ids):
            seq = batch.seqs[i]
            for child, ctok in seq.group.take_forks(seq) if seq.group is not None else ():
                self._fork(seq, child)
                child.output_token_ids.append(ctok)
                if self._stops(child, ctok):
                    child.status = SequenceStatus.FINISHED
                    finished.append(child)
                    self.running.remove(child)
                    self.bm.free(child)
            seq.output_token_ids.append(tok)
            if self._stops(seq, tok):
                seq.status = SequenceStatus.FINISHED
                finished.append(seq)
        self.on_result(batch)
        return finished

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """A new sample shares the parent's blocks (reference counts, no copy) and decodes beside it; the
        shared partial last block is copied when one of them first writes it (copy-on-write)."""
        self.bm.fork_seq(parent, child)
        child.status = SequenceStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_computed_tokens // self.bm.block_size * self.bm.block_size
        self.running.append(child)

    def _stops(self, seq: Sequence, tok: int) -> bool:
        """vLLM's order: no stop before min_tokens; eos (unless ignore_eos), then stop token ids, then length."""
        p = seq.sampling_params
        if len(seq.output_token_ids) >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                seq.finish_reason = "stop"
                return True
            if tok in p.stop_token_set:
                seq.finish_reason, seq.stop_reason = "stop", tok
                return True
        if len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def on_result(self, batch: Batch) -> None:
        """Policy hook: the batch returned and its sequences are updated; release finished ones."""
        done = False
        for seq in batch.seqs:
            seq.in_flight = False
            if seq.is_finished:
                self.bm.free(seq)
                done = True
        if done:
            self.running = [s for s in self.running if not s.is_finished]

    def abort(self, seq: Sequence) -> None:
        """Drop a finished-by-abort sequence that is not in flight: out of its queue, KV blocks freed."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.block_table:
            self.bm.free(seq)
        seq.in_flight = False
        if not self.waiting and not self.running:
            self.reset_idle()

    def reset_idle(self) -> None:
        """Nothing waits or runs: policies drop state about requests that are gone (td-pipe's predicted KV)."""

    # -- shared mechanics ----------------------------------------------------------------------------
    def decode_batch_cap(self) -> int:
        """Decodes per micro-batch: the running set split evenly over the `pipeline_depth` micro-batches in
        flight (as vLLM's virtual engines do), so every pipeline slot gets an equal share."""
        depth = self.config.pipeline_depth
        return max(1, min(self.config.max_num_seqs, -(-len(self.running) // depth)))

    # -- prefix caching: admission counts only what a request really prefills and allocates -------------
    def prefill_plan(self, seq: Sequence, num_tokens: int | None = None) -> PrefixPlan:
        """(prompt tokens already cached, blocks it would take from the free pool) if admitted now; a
        request that needs every prompt position's logits (prompt_logprobs) gets no cache hit."""
        if seq.needs_prompt_logits or not self.bm.enable_prefix_caching:
            n = seq.num_tokens if num_tokens is None else num_tokens
            return PrefixPlan(0, max(0, self.bm.blocks_needed(n) - len(seq.block_table)))
        return self.bm.prefix_plan(seq, num_tokens)

    def can_admit(self, seq: Sequence, reserve: int = 0) -> bool:
        return (self.prefill_plan(seq).num_new_blocks + reserve <= self.bm.num_free_blocks
                and self.window_admits(seq, seq.num_tokens))

    def window_admits(self, seq: Sequence, num_tokens: int) -> bool:
        """Room in the sliding-window pool for seq's prefill up to `num_tokens`, keeping one block per running
        sequence free (a decode may open a new local block before its oldest one leaves the window)."""
        return self.bm.window_pool is None or self.bm.window_fits(seq, num_tokens, len(self.running),
                                                                  prefix=not seq.needs_prompt_logits)

    def _allocate_prompt(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """Blocks for a request being admitted: the longest cached prefix mapped in, fresh blocks up to
        `num_tokens` (default all its tokens); its computed tokens start after the cached prefix."""
        if seq.needs_prompt_logits:
            self.bm.allocate(seq, num_tokens)
            cached = 0
        else:
            cached = self.bm.allocate_with_prefix(seq, num_tokens)
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        return cached

    def _admit(self, seq: Sequence) -> None:
        self._allocate_prompt(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def num_seqs(self) -> int:
        """Sequences counted against max_num_seqs: running ones and the samples they have yet to fork."""
        return sum(s.num_samples_pending for s in self.running)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs of the batch just formed (the engine ships them with it)."""
        copies, self.block_copies = self.block_copies, []
        return copies

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption of a running sequence not in flight, from outside (LLMEngine.pause)."""
        if seq.in_flight:
            raise RuntimeError(f"sequence {seq.seq_id} is in a micro-batch still in flight")
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the KV; the sequence goes back to the front of the waiting queue."""
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _append_slot(self, seq: Sequence) -> None:
        """A KV slot for seq's next token (capacity checked by the caller), with a private copy of a block it
        would write that a fork shares (copy-on-write), in the global and the sliding-window tables."""
        self.bm.append_slot(seq)
        cow = self.bm.prepare_append(seq)  # the block it writes is shared (fork): a private copy
        if cow is not None:
            self.block_copies.append(cow)
            seq.table_epoch += 1
        if self.bm.window_pool is not None and (cow := self.bm.prepare_append_window(seq)) is not None:
            self.block_copies.append(cow)  # numbered past the global pool (prepare_append_window)
            seq.table_epoch += 1

    def _reserve_decode_slots(self, seqs: list[Sequence]) -> list[Sequence]:
        """Give each sequence a KV slot for its next token, preempting the newest running sequences
        (not in flight) when blocks run out. Returns the sequences that got a slot, in order."""
        chosen: list[Sequence] = []
        taken: set[int] = set()
        for seq in seqs:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            if self.bm.writes_in_place(seq):  # the common case: nothing to allocate or copy
                chosen.append(seq)
                taken.add(seq.seq_id)
                continue
            while not self.bm.can_append(seq):
                victim = next((s for s in reversed(self.running)
                               if not s.in_flight and s is not seq and s.seq_id not in taken), None)
                if victim is None:
                    break
                self._preempt(victim)
            if self.bm.can_append(seq):
                self._append_slot(seq)
                chosen.append(seq)
                taken.add(seq.seq_id)
            elif not seq.in_flight:
                self._preempt(seq)
        return chosen
