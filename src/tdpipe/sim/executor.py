"""The simulated executor: the engine's own loop, a virtual clock, and a cost model instead of stages.

Stages run micro-batches in submission order (as the real pipeline does), so when a micro-batch is submitted
its whole path is known: on stage k it starts when both the stage is free and its input has arrived, runs
for the cost model's time, then sends its activations to stage k + 1 (a sender thread: the stage is free
again as soon as it finishes computing). `collect` moves the clock to the micro-batch's return and then
charges the engine's own work for it (sampling, stop checks, scheduling the next one), which the real
engine does while the other micro-batches are in flight. Recorded events have the real runtime's trace
format, so bubble ratios and `tdpipe plot timeline` read simulated runs the same way.
"""
from __future__ import annotations

import time
from collections import deque

from tdpipe.executor.base import Executor, StepResult
from tdpipe.sim.cost import CostModel, StepShape
from tdpipe.step_input import StepInput

SIM_TOKEN = 0  # the token every simulated step "samples" (simulated requests ignore EOS)


class SimExecutor(Executor):
    def __init__(self, cost: CostModel, measured_engine: bool = False) -> None:
        """measured_engine: charge the engine's real time between calls (its Python work on this machine)
        instead of the hardware's fixed engine_step + engine_row per micro-batch."""
        self.cost = cost
        self.num_stages = cost.num_stages
        self.measured_engine = measured_engine
        self.clock = 0.0
        self._free = [0.0] * self.num_stages  # when each stage finishes its last micro-batch
        self._pending: deque[tuple[int, float, int]] = deque()  # (batch id, return time, rows)
        self._events: list[list[dict]] = [[] for _ in range(self.num_stages)]
        self._left = time.perf_counter()  # when control last went back to the engine

    def now(self) -> float:
        return self.clock

    def _engine_time(self) -> None:
        if self.measured_engine:
            t = time.perf_counter()
            self.clock += t - self._left

    def submit(self, step: StepInput) -> None:
        self._engine_time()
        shape = StepShape.of(step.query_lens, step.seq_lens)
        times = self.cost.stage_times(shape)
        allreduce = self.cost.stage_allreduce(shape)
        sends = self.cost.send_times(shape) + [0.0]
        prefill, decode = step.shape()
        ready = self.clock
        for k, dt in enumerate(times):
            start = max(ready, self._free[k])
            end = start + dt
            self._events[k].append({"batch_id": step.batch_id, "start": start, "end": end,
                                    "wait": max(0.0, ready - self._free[k]), "send": sends[k],
                                    "allreduce": allreduce[k],
                                    "prefill_tokens": prefill, "decode_seqs": decode,
                                    "context_tokens": shape.kv_tokens})
            self._free[k] = end
            ready = end + sends[k]
        self._pending.append((step.batch_id, ready, len(step.query_lens)))
        self._left = time.perf_counter()

    def collect(self) -> StepResult:
        self._engine_time()
        batch_id, done, rows = self._pending.popleft()
        self.clock = max(self.clock, done)
        if not self.measured_engine:
            hw = self.cost.hw
            self.clock += hw.engine_step + hw.engine_row * rows
        self._left = time.perf_counter()
        return StepResult(batch_id, token_ids=[SIM_TOKEN] * rows)

    def drain(self) -> None:
        while self._pending:
            self.collect()

    def trace_events(self) -> list[list[dict]]:
        events, self._events = self._events, [[] for _ in range(self.num_stages)]
        return events


__all__ = ["SIM_TOKEN", "SimExecutor"]
