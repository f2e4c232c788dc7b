"""Executors: the only place that knows where compute happens (in-process, stage processes, simulator)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tdpipe.step_input import StepInput

# Trace events a stage keeps until the engine collects them: the last ones only, so a stage of an engine that
# never asks (a server without --trace) does not grow. A busy-ratio sampler collects every second or so.
MAX_STAGE_EVENTS = 100_000


def host_logits(logits: torch.Tensor, step: StepInput) -> torch.Tensor:
    """The logits handed to the engine: float32 for its sampler, except a step with prompt_logprobs rows,
    whose [rows, vocab] stays in the model's dtype (the engine converts the rows it samples, and the prompt
    logprobs chunk by chunk): 8,192 prefill rows of a 262k vocabulary are 8.6 GB in float32."""
    if step.all_logits and any(step.all_logits):
        return logits
    return logits.float() if logits.dtype != torch.float32 else logits


@dataclass
class StepResult:
    batch_id: int
    logits: torch.Tensor | None = None  # [S, V] float, one row per sequence
    token_ids: list[int] | None = None  # argmax, when the batch is greedy-only (SiPipe §5.1)
    timings: dict[str, float] = field(default_factory=dict)


class Executor:
    num_stages: int = 1
    # submit() returns before the micro-batch is computed (stage processes, or a GPU's queued work): the engine
    # then refills the pipeline before handing a step's deltas back. An executor that computes inside submit()
    # (the CPU's in-process one) is not: refilling first would only hold the deltas back by one step.
    asynchronous: bool = False

    def now(self) -> float:
        """The clock the engine stamps requests and traces with: wall time, or a simulator's virtual time."""
        return time.time()

    def submit(self, step: StepInput) -> None:
        raise NotImplementedError

    def collect(self) -> StepResult:
        """The oldest submitted micro-batch's result (blocking)."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether collect() would return without waiting (an executor that computes in submit(): always)."""
        return True

    def drain(self) -> int | None:
        """Wait for every submitted micro-batch and drop its result, leaving nothing in flight: how the
        engine recovers from an exception (a KeyboardInterrupt) between submit() and collect()."""
        raise NotImplementedError

    def release(self, seq_ids: list[int]) -> None:
        """These sequences finished (stages may drop their block tables)."""

    def trace_events(self) -> list[list[dict]]:
        """Per stage, the trace events recorded since the last call (absolute time.time() stamps)."""
        return [[] for _ in range(self.num_stages)]

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Call `method` of every worker's ModelRunner (every stage, every tensor-parallel rank) with `args`,
        with nothing in flight; the results in worker order (vLLM's LLM.collective_rpc). What weight updates
        and sleep / wake_up are built on (core/weight_sync.py)."""
        raise NotImplementedError(f"{type(self).__name__} has no workers to call {method!r} on")

    def shutdown(self) -> None:
        pass
