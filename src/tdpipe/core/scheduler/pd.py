"""Prefill/decode disaggregation in space (DistServe; the lecture's §4), the control plane's scheduling: prefill
instances compute prompts and their first token, decode instances decode continuously, and each instance has
its own KV cache and page table, all kept here in the one engine (TD-Pipe §3.2's centralised control plane).

A request's life: it waits on a prefill instance (the least loaded one when it arrives), is admitted with its
whole prompt (prefix caching works there: a cached prefix is neither computed nor allocated again) and takes
one staging slot per KV block; its prefill step exports the blocks to those slots after computing
(worker/kv_transfer.py). When that step returns and the first token is sampled, its prefill blocks are freed
(cached full blocks stay in that instance's prefix cache) and it waits, KV in staging, for a decode instance
with room. The decode instance's next decode step imports the blocks before it runs, so a request is decoded
only once its KV has arrived; the slots are freed when that step returns. A decode instance that runs out of
blocks preempts by recompute: the request goes back to a prefill instance and prefills again.

Each instance runs at most one micro-batch at a time; prefill and decode micro-batches run concurrently on
their instances. Not a registered policy: `disaggregation="pd"` picks it (core/pd_parts.py builds it).
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Callable, Iterable

from tdpipe.config import SchedulerConfig
from tdpipe.core.batch import Batch
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.kv_staging import StagingSlots
from tdpipe.core.scheduler.separate import SeparateScheduler
from tdpipe.sequence import Sequence, SequenceStatus

MAX_TRANSFER_LOG = 1000  # the last transfers kept for inspection (tests check them block by block)


class PrefillSide(SeparateScheduler):
    """One prefill instance: whole prompts up to the token budget per micro-batch (a longer one alone), each
    admitted only with staging slots for all its blocks, the batch exporting them after it computes."""

    def __init__(self, config: SchedulerConfig, bm: BlockManager, eos: Iterable[int], slots: StagingSlots,
                 instance: int) -> None:
        super().__init__(config, bm, eos)
        self.slots, self.instance = slots, instance

    def prefill_closed(self, seq: Sequence) -> bool:
        return self.bm.blocks_needed(seq.num_tokens) > self.slots.num_free

    def on_prefill_admit(self, seq: Sequence) -> None:
        self.slots.take(seq.seq_id, len(seq.block_table))

    def schedule(self) -> Batch | None:
        batch = self._schedule_prefill()
        if batch is not None:
            batch.instance = self.instance
            batch.kv_export = [p for s in batch.seqs for p in zip(s.block_table, self.slots.held[s.seq_id])]
        return batch


class DecodeSide(SeparateScheduler):
    """One decode instance: every running request in each micro-batch; a preempted one goes back to prefill
    (`requeue`)."""

    def __init__(self, config: SchedulerConfig, bm: BlockManager, eos: Iterable[int], instance: int,
                 requeue: Callable[[Sequence], None]) -> None:
        super().__init__(config, bm, eos)
        self.instance, self.requeue = instance, requeue

    def decode_batch_cap(self) -> int:
        return max(1, min(self.config.max_num_seqs, len(self.running)))  # one micro-batch in flight per instance

    def schedule(self) -> Batch | None:
        batch = self._schedule_decode()
        if batch is not None:
            batch.instance = self.instance
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.running.remove(seq)
        self.num_preemptions += 1
        self.requeue(seq)


class PDScheduler:
    """The engine's scheduler for `disaggregation="pd"`: P prefill sides and D decode sides, numbered as the
    executor numbers its instances (prefill 0..P-1, decode P..P+D-1), and the requests between them."""

    def __init__(self, config: SchedulerConfig, prefill_bms: list[BlockManager], decode_bms: list[BlockManager],
                 slots: StagingSlots, eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.slots = slots
        eos = frozenset(eos_token_ids)
        self.prefill = [PrefillSide(config, bm, eos, slots, k) for k, bm in enumerate(prefill_bms)]
        p = len(self.prefill)
        self.decode = [DecodeSide(config, bm, eos, p + k, self._requeue) for k, bm in enumerate(decode_bms)]
        ids = itertools.count()  # batch ids unique over every instance: the engine matches results by them
        for side in self.sides:
            side._ids = ids
        self.arrived: deque[Sequence] = deque()  # prefilled, KV in staging, waiting for a decode instance
        self._imports: dict[int, list[tuple[int, int]]] = {}  # seq_id -> (slot, block) pairs of its next decode
        self._importing: dict[int, list[int]] = {}  # decode batch id -> seqs whose slots it frees on return
        self._busy: set[int] = set()  # instances with a micro-batch in flight
        self._origin: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (prefill instance, its blocks there)
        self.transfers: deque[dict] = deque(maxlen=MAX_TRANSFER_LOG)

    @property
    def sides(self) -> list[SeparateScheduler]:
        return [*self.prefill, *self.decode]

    # -- the engine's scheduler interface ----------------------------------------------------------------
    @property
    def waiting(self) -> list[Sequence]:
        return [s for side in self.prefill for s in side.waiting]

    @property
    def running(self) -> list[Sequence]:
        return [*(s for side in self.prefill for s in side.running), *self.arrived,
                *(s for side in self.decode for s in side.running)]

    @property
    def num_preemptions(self) -> int:
        return sum(side.num_preemptions for side in self.decode)

    def block_managers(self) -> list[BlockManager]:
        return [side.bm for side in self.sides]

    def add(self, seq: Sequence) -> None:
        if seq.num_samples_pending > 1:
            raise ValueError("n / best_of > 1 is not supported with disaggregation 'pd' (one sample per request)")
        if seq.needs_prompt_logits:
            raise ValueError("prompt_logprobs is not supported with disaggregation 'pd'")
        self._least_loaded().add(seq)

    def _least_loaded(self) -> PrefillSide:
        return min(self.prefill, key=lambda s: s.num_unfinished())

    def _requeue(self, seq: Sequence) -> None:
        """Back to a prefill instance (recompute): the slots of an import not yet sent go back."""
        self._imports.pop(seq.seq_id, None)
        self.slots.release(seq.seq_id)
        self._least_loaded().waiting.appendleft(seq)

    def has_unfinished(self) -> bool:
        return bool(self.arrived) or any(side.has_unfinished() for side in self.sides)

    def num_unfinished(self) -> int:
        return len(self.arrived) + sum(side.num_unfinished() for side in self.sides)

    def schedule(self) -> Batch | None:
        """The next micro-batch for an idle instance, decode instances first (they decode continuously)."""
        for side in self.decode:
            if side.instance in self._busy:
                continue
            self._admit_arrived(side)
            batch = side.schedule()
            if batch is not None:
                batch.kv_import = [p for s in batch.seqs for p in self._imports.pop(s.seq_id, ())]
                self._importing[batch.batch_id] = [s.seq_id for s in batch.seqs if s.seq_id in self.slots.held]
                self._busy.add(side.instance)
                return batch
        for side in self.prefill:
            if side.instance in self._busy:
                continue
            batch = side.schedule()
            if batch is not None:
                self._busy.add(side.instance)
                return batch
        return None

    def _admit_arrived(self, side: DecodeSide) -> None:
        """Requests whose KV waits in staging join this decode instance while it has blocks for them (and the
        watermark) and room under max_num_seqs; their import rides with its next micro-batch."""
        while self.arrived and len(side.running) < self.config.max_num_seqs:
            seq = self.arrived[0]
            n = seq.num_computed_tokens
            if side.bm.blocks_needed(n) + side.watermark_blocks > side.bm.num_free_blocks:
                break
            self.arrived.popleft()
            blocks = side.bm.allocate(seq, n)
            slots = self.slots.held[seq.seq_id]
            self._imports[seq.seq_id] = list(zip(slots, blocks))
            side.running.append(seq)
            src, src_blocks = self._origin.pop(seq.seq_id)
            self.transfers.append({"seq_id": seq.seq_id, "request_id": seq.request_id, "tokens": n,
                                   "from": src, "to": side.instance, "slots": list(slots),
                                   "prefill_blocks": src_blocks, "decode_blocks": list(blocks)})

    def update_from_output(self, batch: Batch, token_ids: list[int]) -> list[Sequence]:
        side = self.sides[batch.instance]
        finished = side.update_from_output(batch, token_ids)
        self._busy.discard(batch.instance)
        if isinstance(side, PrefillSide):
            for seq in batch.seqs:
                if seq.is_finished:  # done at its first token, or aborted in flight: nothing to ship
                    self.slots.release(seq.seq_id)
                    continue
                self._origin[seq.seq_id] = (side.instance, list(seq.block_table))
                side.running.remove(seq)
                side.bm.free(seq)  # its KV is in staging now; full blocks stay in the prefix cache
                self.arrived.append(seq)
        for sid in self._importing.pop(batch.batch_id, ()):
            self.slots.release(sid)
        return finished

    def abort(self, seq: Sequence) -> None:
        """A finished-by-abort sequence not in flight: out of whatever queue holds it, blocks and slots freed."""
        if seq in self.arrived:
            self.arrived.remove(seq)
            self._origin.pop(seq.seq_id, None)
        for side in self.sides:
            if seq in side.waiting or seq in side.running:
                side.abort(seq)
        self._imports.pop(seq.seq_id, None)
        self.slots.release(seq.seq_id)
        seq.in_flight = False

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption from outside (LLMEngine.pause)."""
        if seq.in_flight:
            raise RuntimeError(f"sequence {seq.seq_id} is in a micro-batch still in flight")
        if seq in self.arrived:
            self.arrived.remove(seq)
            self._origin.pop(seq.seq_id, None)
            seq.reset_for_recompute()
            seq.status = SequenceStatus.WAITING
            self._requeue(seq)
            return
        for side in self.decode:
            if seq in side.running:
                side.preempt(seq)
                return

    def reset_idle(self) -> None:
        for side in self.sides:
            side.reset_idle()
        if not self.has_unfinished():
            self._busy.clear()
            self._importing.clear()
            self._origin.clear()

    def take_block_copies(self) -> list[tuple[int, int]]:
        return [c for side in self.sides for c in side.take_block_copies()]  # none: one sample per request


__all__ = ["DecodeSide", "PDScheduler", "PrefillSide"]
