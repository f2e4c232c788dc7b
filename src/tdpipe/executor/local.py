"""pp = 1: the model in the engine's process.

On a GPU the executor is deferred: submit() queues the step's kernels (the forward, the stage's sampling and
the copy of its tokens or logits to pinned host memory) and returns; collect() waits for that copy. The
engine then schedules and prepares the next micro-batch, and the caller detokenises, while the device
computes (SiPipe §4, host work off the critical path); with --pipeline-depth 2 a second micro-batch is queued
behind the first. On a CPU the forward runs in submit() on the engine's own threads: nothing would overlap."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from tdpipe.executor.base import MAX_STAGE_EVENTS, Executor, StepResult, host_logits
from tdpipe.model import cpu_ops as ops
from tdpipe.sampling.stage_rows import split_rows
from tdpipe.step_input import StepInput
from tdpipe.worker.model_runner import ModelRunner

ANCHOR_S = 60.0  # pair the device's clock with the host's again after this long (when idle)


@dataclass
class _Queued:
    """A submitted step whose device work may still run: `finish` turns its host copies into the result once
    `done` (a CUDA event after the copies; None on a CPU) has completed."""
    step: StepInput
    t0: float  # submit() entered
    t1: float  # inputs prepared, forward queued from here
    began: object | None  # CUDA event before the forward
    done: object | None  # CUDA event after the copies to the host
    t2: float  # submit() returned (on a CPU, the forward done)
    finish: Callable[[], tuple[list[int] | None, torch.Tensor | None]]


class LocalExecutor(Executor):
    def __init__(self, runner: ModelRunner, deferred: bool | None = None) -> None:
        """deferred: queue each step's device work and wait for it in collect() (default: on a CUDA device)."""
        self.runner = runner
        self.cuda = torch.device(runner.device).type == "cuda"
        self.asynchronous = self.cuda if deferred is None else deferred
        self._queued: deque[_Queued] = deque()
        self._events: deque[dict] = deque(maxlen=MAX_STAGE_EVENTS)
        self._anchor: tuple[float, object] | None = None  # (host time, CUDA event) that device times count from
        if self.cuda:
            self._reanchor()

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if self.cuda:
            self.drain_device()
        return [getattr(self.runner, method)(*args)]

    def submit(self, step: StepInput) -> None:
        t0 = time.time()
        if self.cuda and not self._queued and t0 - self._anchor[0] > ANCHOR_S:  # type: ignore[index]
            self._reanchor()  # idle (every step collected): the host and device clocks paired again
        inp = self.runner.prepare(step)
        t1 = time.time()
        began = self._event()
        logits = self.runner.execute(inp)
        finish = self._queue_outputs(logits, step)
        self._queued.append(_Queued(step, t0, t1, began, self._event(), time.time(), finish))

    def _queue_outputs(self, logits: torch.Tensor,
                       step: StepInput) -> Callable[[], tuple[list[int] | None, torch.Tensor | None]]:
        """Queue what reads this step's logits (sampling, copies to the host) now, behind its forward and
        before the next step's (a captured graph's output buffer is reused); the returned closure reads the
        host copies once they have landed."""
        nb = self.cuda
        if step.greedy_rows and all(step.greedy_rows):
            ids = (self.runner.sample(logits, step.temperatures, step.stage_seed) if step.temperatures
                   else ops.argmax(logits))  # stage sampling (sampling/stage_rows.py), or the plain argmax
            host = ids.to("cpu", non_blocking=nb)
            return lambda: (host.tolist(), None)
        if split_rows(step.greedy_rows, step.temperatures, step.all_logits):
            # the stage samples some rows: ids of its rows (-1 for the others) and the others' logits, in row
            # order (sampling/stage_rows.stage_tokens reads them so)
            mine = step.greedy_rows
            ids = self.runner.sample(logits, step.temperatures, step.stage_seed).to("cpu", non_blocking=nb)
            rest = logits[torch.tensor([i for i, m in enumerate(mine) if not m], device=logits.device)]
            rest = rest.float().to("cpu", non_blocking=nb)
            return lambda: ([t if m else -1 for t, m in zip(ids.tolist(), mine)], rest)
        out = logits.to("cpu", non_blocking=nb)  # the engine samples on the host (no copy on a CPU)
        return lambda: (None, host_logits(out, step))

    def _event(self) -> object | None:
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _reanchor(self) -> None:
        torch.cuda.synchronize()
        ev = self._event()
        ev.synchronize()  # type: ignore[union-attr]
        self._anchor = (time.time(), ev)

    def _device_time(self, ev: object) -> float:
        """A completed CUDA event's time on the host's clock: the device's own timer, counted from an event
        recorded while the device was idle, so a step queued behind another starts when it really did."""
        host, anchor = self._anchor  # type: ignore[misc]
        return host + anchor.elapsed_time(ev) / 1e3  # type: ignore[attr-defined]

    def collect(self) -> StepResult:
        q = self._queued[0]
        if q.done is not None:
            q.done.synchronize()  # type: ignore[attr-defined]  (interrupted here, the step stays queued)
            start, end = self._device_time(q.began), self._device_time(q.done)
        else:
            start, end = q.t1, q.t2
        self._queued.popleft()
        token_ids, out = q.finish()
        step = q.step
        prefill, decode = step.shape()
        # input preparation runs inline here, so it counts as waiting (the pipeline overlaps it)
        self._events.append({"batch_id": step.batch_id, "start": start, "end": end, "wait": q.t1 - q.t0,
                             "send": 0.0, "prefill_tokens": prefill, "decode_seqs": decode,
                             "context_tokens": sum(step.seq_lens)})
        return StepResult(step.batch_id, logits=out, token_ids=token_ids,
                          timings={"prepare": q.t1 - q.t0, "compute": end - start, "start": q.t0, "end": end})

    def ready(self) -> bool:
        q = self._queued[0] if self._queued else None
        return q is None or q.done is None or bool(q.done.query())  # type: ignore[attr-defined]

    def trace_events(self) -> list[list[dict]]:
        events, self._events = list(self._events), deque(maxlen=MAX_STAGE_EVENTS)
        return [events]

    def drain_device(self) -> None:
        """Wait for the queued device work (before an RPC changes the weights or the caches under it)."""
        for q in self._queued:
            if q.done is not None:
                q.done.synchronize()  # type: ignore[attr-defined]

    def drain(self) -> None:
        self.drain_device()
        self._queued.clear()
