"""Prefill/decode disaggregation's executor: one executor per instance (prefill instances 0..P-1, decode
instances P..P+D-1), each with its own KV cache (and, when built from a model folder, its own worker process
pinned to its own cores: core/pd_parts.py). A step goes to the instance it names (StepInput.instance); the
result returned is that of the first instance whose oldest step is done, so a long prefill never holds back a
decode that finished behind it (the engine matches a result to its batch by batch id)."""
from __future__ import annotations

import time
from collections import deque

from tdpipe.executor.base import Executor, StepResult
from tdpipe.step_input import StepInput

_POLL = (0.0002, 0.002)  # seconds: first and longest sleep between looks at the instances' results


class PDExecutor(Executor):
    num_stages = 1  # the engine's trace has one row; each event names its instance

    def __init__(self, instances: list[Executor], num_prefill: int) -> None:
        self.instances = instances
        self.num_prefill = num_prefill
        self._order: deque[int] = deque()  # the instance of each step in flight, in submission order
        self._seqs: dict[int, deque[list[int]]] = {k: deque() for k in range(len(instances))}

    def now(self) -> float:
        return self.instances[0].now()

    def submit(self, step: StepInput) -> None:
        k = step.instance
        self.instances[k].submit(step)
        self._order.append(k)
        self._seqs[k].append(step.seq_ids)

    def ready(self) -> bool:
        return any(self.instances[k].ready() for k in set(self._order))

    def collect(self) -> StepResult:
        """The oldest step of the first instance (in submission order) whose oldest step is done."""
        pause = _POLL[0]
        while True:
            k = next((k for k in self._order if self.instances[k].ready()), None)
            if k is not None:
                break
            time.sleep(pause)
            pause = min(2 * pause, _POLL[1])
        result = self.instances[k].collect()
        self._order.remove(k)
        seq_ids = self._seqs[k].popleft()
        if k < self.num_prefill:  # the prompts moved on (to staging) or finished: their tables there go
            self.instances[k].release(seq_ids)
        return result

    def drain(self) -> int:
        dropped = 0
        for ex in self.instances:
            dropped += ex.drain() or 0
        self._order.clear()
        for q in self._seqs.values():
            q.clear()
        return dropped

    def release(self, seq_ids: list[int]) -> None:
        for ex in self.instances:
            ex.release(seq_ids)

    def trace_events(self) -> list[list[dict]]:
        """The events of the instances with no step in flight (the others' stay with them until a later call:
        asking a busy worker waits for its step, which would stall every other instance's next step)."""
        events = []
        for k, ex in enumerate(self.instances):
            if k in self._order:
                continue
            for stage in ex.trace_events():
                events += [{**e, "instance": k} for e in stage]
        events.sort(key=lambda e: e.get("start", 0.0))
        return [events]

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return [r for ex in self.instances for r in ex.collective_rpc(method, args)]

    def instance_rpc(self, k: int, method: str, args: tuple = ()) -> list:
        """`method` of instance k's model runner(s) only (a test reads one side's KV blocks so)."""
        return self.instances[k].collective_rpc(method, args)

    def shutdown(self) -> None:
        for ex in self.instances:
            ex.shutdown()


__all__ = ["PDExecutor"]
