"""pp = 1: the model in the engine's process."""
from __future__ import annotations

import time
from collections import deque

import torch

from tdpipe.core.batch import StepInput
from tdpipe.executor.base import Executor, StepResult
from tdpipe.model import cpu_ops as ops
from tdpipe.worker.model_runner import ModelRunner


class LocalExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._done: deque[StepResult] = deque()

    def submit(self, step: StepInput) -> None:
        t0 = time.perf_counter()
        inp = self.runner.prepare(step)
        t1 = time.perf_counter()
        logits = self.runner.execute(inp)
        t2 = time.perf_counter()
        res = StepResult(step.batch_id, timings={"prepare": t1 - t0, "compute": t2 - t1, "start": t0, "end": t2})
        if step.greedy_rows and all(step.greedy_rows):
            res.token_ids = ops.argmax(logits).tolist()
        else:
            res.logits = logits.float() if logits.dtype != torch.float32 else logits
        self._done.append(res)

    def collect(self) -> StepResult:
        return self._done.popleft()
