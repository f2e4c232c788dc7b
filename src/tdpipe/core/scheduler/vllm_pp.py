"""`vllm-pp` (PP+SB as TD-Pipe §4.1 ran it): vLLM 0.5.3's pipeline parallelism, one scheduler per virtual engine.

TD-Pipe §4.1 compares against PP+SB "implemented in vLLM" 0.5.3. That vLLM ran pipeline parallelism as pp
*virtual engines*, each a whole v0 scheduler of its own:
  - a request is bound to one virtual engine when it arrives, for its whole life (LLMEngine.add_request: the
    scheduler with the fewest unfinished requests), and only that engine ever schedules it;
  - each engine owns 1/pp of the KV blocks (Scheduler.__init__: num_gpu_blocks //= pipeline_parallel_size),
    its own max_num_seqs and token budget, and preempts (recompute) only its own requests;
  - each engine forms one micro-batch at a time, the next as soon as its previous one returned
    (AsyncLLMEngine's loop), prefill first and never mixed with decodes (separate batching).
So micro-batch k always carries engine k's requests: when they finish at different times the micro-batches
drift apart in size and the pipeline waits on the largest, and near the end of a run some engines are empty
while others still decode. `separate` (PP+SB in tdpipe) re-splits all running requests evenly over the
micro-batches at every step and has none of that drift (docs/simulator.md).

Virtual engines here are the micro-batches in flight (`pipeline_depth`, default pp). `--slot-binding`:
`fewest-unfinished` (vLLM's rule) or `most-free-kv` (the engine whose KV share has the most room once its
queued prompts are counted). One departure, for liveness: a request too large for one engine's share of the
KV runs alone in its engine on the shared pool (vLLM refused such a prompt and could livelock on its decode).
Pure Python.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator

from tdpipe.config import SchedulerConfig
from tdpipe.core.batch import Batch
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler.base import Scheduler
from tdpipe.core.scheduler.registry import register_policy
from tdpipe.options import option
from tdpipe.sequence import Sequence, SequenceStatus

BINDINGS = ("fewest-unfinished", "most-free-kv")


@dataclass
class VllmPPKnobs:
    """How a request picks its virtual engine (vLLM 0.5.3: the fewest unfinished requests)."""

    slot_binding: str = option(
        "fewest-unfinished", "vllm-pp: the virtual engine a new request is bound to for life: 'fewest-unfinished' "
                             "(vLLM 0.5.3's LLMEngine.add_request) or 'most-free-kv' (most room in its KV share after "
                             "its queued prompts; default: %(default)s)", "--slot-binding", choices=BINDINGS)

    def __post_init__(self) -> None:
        if self.slot_binding not in BINDINGS:
            raise ValueError(f"slot_binding must be one of {list(BINDINGS)}, got {self.slot_binding!r}")


class SlotQueues:
    """The waiting requests, one FCFS queue per virtual engine, seen by the base Scheduler and the engine as one
    queue (`self.waiting`: truth, length, membership, iteration, append / appendleft / remove route by slot)."""

    def __init__(self, num_slots: int, slot_of: dict[int, int]) -> None:
        self.queues: list[deque[Sequence]] = [deque() for _ in range(num_slots)]
        self.slot_of = slot_of

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues)

    def __bool__(self) -> bool:
        return any(self.queues)

    def __iter__(self) -> Iterator[Sequence]:
        return itertools.chain.from_iterable(self.queues)

    def __contains__(self, seq: object) -> bool:
        q = self._queue(seq)
        return q is not None and seq in q

    def _queue(self, seq: object) -> deque[Sequence] | None:
        slot = self.slot_of.get(getattr(seq, "seq_id", None))
        return None if slot is None else self.queues[slot]

    def append(self, seq: Sequence) -> None:
        self.queues[self.slot_of[seq.seq_id]].append(seq)

    def appendleft(self, seq: Sequence) -> None:  # a preempted request goes back to the front of its own engine
        self.queues[self.slot_of[seq.seq_id]].appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        q = self._queue(seq)
        if q is None:
            raise ValueError(f"sequence {getattr(seq, 'seq_id', seq)} is not waiting")
        q.remove(seq)


@register_policy(
    "vllm-pp", default_token_budget=8192, knobs=VllmPPKnobs,  # separate's budget: the binding is the one difference
    help="PP+SB as TD-Pipe §4.1 ran it (vLLM 0.5.3's virtual engines): each request bound for life to one "
         "micro-batch slot with its own 1/pp of the KV cache and max_num_seqs / pp (--slot-binding), each slot "
         "prefill first, never mixed, so micro-batches drift apart as requests finish",
    budget_help="most prompt tokens in one virtual engine's prefill batch, a longer prompt runs alone")
class VllmPPScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: Iterable[int] = ()) -> None:
        super().__init__(config, block_manager, eos_token_ids)
        self.knobs: VllmPPKnobs = config.knobs or VllmPPKnobs()
        # one virtual engine per micro-batch in flight, each with at least one sequence of max_num_seqs
        n = self.num_slots = max(1, min(config.pipeline_depth, config.max_num_seqs))
        self.slot_of: dict[int, int] = {}  # seq_id -> virtual engine, for the request's whole life
        self.bound = [0] * n  # unfinished sequences per engine (waiting + running)
        self.waiting = SlotQueues(n, self.slot_of)  # type: ignore[assignment]
        self.quota = [block_manager.num_blocks // n] * n  # each engine's share of the KV blocks
        self.max_seqs = [config.max_num_seqs // n + (v < config.max_num_seqs % n) for v in range(n)]
        self.slot_watermark = [max(1, int(0.01 * q)) if q > 100 else 0 for q in self.quota]  # vLLM's 1%, per engine
        self._returns = itertools.count()
        self.returned_at = list(range(-n, 0))  # when each engine's last micro-batch came back (order only)
        self.batch_slot: dict[int, int] = {}  # batch id -> its engine

    # -- binding ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._bind(seq, self.pick_slot())
        self.waiting.append(seq)

    def pick_slot(self) -> int:
        """The virtual engine a new request joins (ties: the lowest index, as vLLM's list.index(min))."""
        if self.knobs.slot_binding == "most-free-kv":
            held = self._held_blocks()
            queued = [sum(self.bm.blocks_needed(s.num_tokens) for s in q) for q in self.waiting.queues]
            room = [self.quota[v] - held[v] - queued[v] for v in range(self.num_slots)]
            return room.index(max(room))
        return self.bound.index(min(self.bound))

    def _bind(self, seq: Sequence, slot: int) -> None:
        self.slot_of[seq.seq_id] = slot
        self.bound[slot] += 1

    def _release(self, seq: Sequence) -> None:
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self.bound[slot] -= 1

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        self._bind(child, self.slot_of[parent.seq_id])  # a sample decodes in its parent's engine
        super()._fork(parent, child)

    def update_from_output(self, batch: Batch, token_ids: list[int]) -> list[Sequence]:
        finished = super().update_from_output(batch, token_ids)
        for seq in finished:  # forked samples that stop at once are not in batch.seqs
            self._release(seq)
        return finished

    def on_result(self, batch: Batch) -> None:
        slot = self.batch_slot.pop(batch.batch_id, None)
        if slot is not None:
            self.returned_at[slot] = next(self._returns)
        for seq in batch.seqs:
            if seq.is_finished:
                self._release(seq)
        super().on_result(batch)

    def abort(self, seq: Sequence) -> None:
        super().abort(seq)
        self._release(seq)

    def reset_idle(self) -> None:
        self.batch_slot.clear()  # batches dropped in flight (LLMEngine.abort_all) never came back

    # -- per-engine state ------------------------------------------------------------------------------
    def _held_blocks(self) -> list[int]:
        held = [0] * self.num_slots
        for s in self.running:
            slot = self.slot_of.get(s.seq_id)
            if slot is not None:
                held[slot] += len(s.block_table)
        return held

    def slot_running(self) -> list[list[Sequence]]:
        """Each engine's running sequences, oldest first."""
        out: list[list[Sequence]] = [[] for _ in range(self.num_slots)]
        for s in self.running:
            slot = self.slot_of.get(s.seq_id)
            if slot is not None:
                out[slot].append(s)
        return out

    # -- scheduling ------------------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """The next micro-batch: from the free engine whose last micro-batch came back first (AsyncLLMEngine
        steps each engine again as soon as its result is in); an engine with nothing to run is passed over."""
        running = self.slot_running()
        busy = [any(s.in_flight for s in r) for r in running]
        for slot in sorted((v for v in range(self.num_slots) if not busy[v]), key=self.returned_at.__getitem__):
            batch = self._schedule_slot(slot, running[slot])
            if batch is not None:
                self.batch_slot[batch.batch_id] = slot
                for s in batch.seqs:
                    s.in_flight = True
                return batch
        return None

    def _schedule_slot(self, slot: int, running: list[Sequence]) -> Batch | None:
        """vLLM v0's default policy inside one engine: its waiting prompts if any fit, else its decodes."""
        batch = self._prefill(slot, running)
        if batch is None:
            batch = self._decode(slot, running)
            if batch is None and self.waiting.queues[slot]:  # every decode was preempted: their prompts again
                batch = self._prefill(slot, [s for s in running if s.status is SequenceStatus.RUNNING])
        return batch

    def _prefill(self, slot: int, running: list[Sequence]) -> Batch | None:
        queue = self.waiting.queues[slot]
        budget = self.config.max_num_batched_tokens
        held = sum(len(s.block_table) for s in running)
        num_seqs = sum(s.num_samples_pending for s in running)
        seqs: list[Sequence] = []
        lens: list[int] = []
        # an engine with nothing running takes its next request even if its samples (n > 1) pass its share
        while queue and (num_seqs + queue[0].num_samples_pending <= self.max_seqs[slot] or not (running or seqs)):
            seq = queue[0]
            plan = self.prefill_plan(seq)
            n = seq.num_tokens - plan.num_cached_tokens
            if n > budget and seqs:  # never chunked: a lone prompt may exceed the budget
                break
            need = plan.num_new_blocks
            alone = not running and not seqs  # too big for one share: it runs alone on the shared pool
            if need + self.slot_watermark[slot] > self.quota[slot] - held and not alone:
                break
            if need > self.bm.num_free_blocks:  # the shared pool (only short when a lone request overflowed)
                break
            if self.bm.window_pool is not None and not self.window_admits(seq, seq.num_tokens):
                break
            queue.popleft()
            self._admit(seq)
            seqs.append(seq)
            lens.append(seq.num_tokens - seq.num_computed_tokens)
            held += len(seq.block_table)
            num_seqs += seq.num_samples_pending
            budget -= lens[-1]
        if not seqs:
            return None
        return Batch(self.next_batch_id(), seqs, lens, is_prefill=True)

    def _append_blocks(self, seq: Sequence) -> int:
        """Blocks seq's next decode token takes: a new one when its last is full or shared (copy-on-write)."""
        bm = self.bm
        if bm.blocks_needed(seq.num_tokens) > len(seq.block_table):
            return 1
        i = (seq.num_tokens - 1) // bm.block_size
        return 1 if i < len(seq.block_table) and bm.ref_counts[seq.block_table[i]] > 1 else 0

    def _fits_append(self, seq: Sequence, slot: int, held: int, alone: bool) -> bool:
        """Room for seq's next token: in the engine's share (or anywhere, for a request alone in its engine)
        and in the shared pool."""
        need = self._append_blocks(seq)
        return self.bm.can_append(seq) and (need == 0 or held + need <= self.quota[slot] or alone)

    def _decode(self, slot: int, running: list[Sequence]) -> Batch | None:
        """Every running request of the engine decodes (vLLM's _schedule_running): each gets a KV slot within
        the engine's share, preempting the engine's newest requests (recompute), or itself when none is left."""
        held = sum(len(s.block_table) for s in running)
        live = list(running)  # not yet given a slot, oldest first; victims come off the end
        chosen: list[Sequence] = []
        while live:
            seq = live.pop(0)
            while live and not self._fits_append(seq, slot, held, alone=False):
                victim = live.pop()
                held -= len(victim.block_table)
                self._preempt(victim)
            if not self._fits_append(seq, slot, held, alone=not live and not chosen):
                held -= len(seq.block_table)
                self._preempt(seq)
                continue
            before = len(seq.block_table)
            self._append_slot(seq)
            held += len(seq.block_table) - before
            chosen.append(seq)
        if not chosen:
            return None
        return Batch(self.next_batch_id(), chosen, [1] * len(chosen), is_prefill=False)


__all__ = ["BINDINGS", "SlotQueues", "VllmPPKnobs", "VllmPPScheduler"]
