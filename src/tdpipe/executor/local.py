"""pp = 1: the model in the engine's process."""
from __future__ import annotations

import time
from collections import deque

import torch

from tdpipe.executor.base import MAX_STAGE_EVENTS, Executor, StepResult, host_logits
from tdpipe.model import cpu_ops as ops
from tdpipe.sampling.stage_rows import split_rows
from tdpipe.step_input import StepInput
from tdpipe.worker.model_runner import ModelRunner


class LocalExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._done: deque[StepResult] = deque()
        self._events: deque[dict] = deque(maxlen=MAX_STAGE_EVENTS)

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return [getattr(self.runner, method)(*args)]

    def submit(self, step: StepInput) -> None:
        t0 = time.time()
        inp = self.runner.prepare(step)
        t1 = time.time()
        logits = self.runner.execute(inp)
        if step.greedy_rows and all(step.greedy_rows):
            if step.temperatures:  # stage sampling (sampling/stage_rows.py)
                token_ids, out = self.runner.sample(logits, step.temperatures, step.stage_seed).tolist(), None
            else:
                token_ids, out = ops.argmax(logits).tolist(), None
        elif split_rows(step.greedy_rows, step.temperatures, step.all_logits):
            token_ids, out = self._split(logits, step)
        else:
            logits = logits.cpu()  # the engine samples on the host (no copy on CPU)
            token_ids, out = None, host_logits(logits, step)
        t2 = time.time()
        prefill, decode = step.shape()
        # input preparation runs inline here, so it counts as waiting (the pipeline overlaps it)
        self._events.append({"batch_id": step.batch_id, "start": t1, "end": t2, "wait": t1 - t0, "send": 0.0,
                             "prefill_tokens": prefill, "decode_seqs": decode,
                             "context_tokens": sum(step.seq_lens)})
        self._done.append(StepResult(step.batch_id, logits=out, token_ids=token_ids,
                                     timings={"prepare": t1 - t0, "compute": t2 - t1, "start": t0, "end": t2}))

    def _split(self, logits: torch.Tensor, step: StepInput) -> tuple[list[int], torch.Tensor]:
        """A batch the stage samples in part: ids of its rows (-1 for the others) and the others' logits,
        in row order (sampling/stage_rows.stage_tokens reads them so)."""
        mine = step.greedy_rows
        ids = self.runner.sample(logits, step.temperatures, step.stage_seed).tolist()
        token_ids = [t if m else -1 for t, m in zip(ids, mine)]
        rest = logits[torch.tensor([i for i, m in enumerate(mine) if not m], device=logits.device)]
        return token_ids, rest.cpu().float()

    def trace_events(self) -> list[list[dict]]:
        events, self._events = list(self._events), deque(maxlen=MAX_STAGE_EVENTS)
        return [events]

    def collect(self) -> StepResult:
        return self._done.popleft()

    def drain(self) -> None:
        self._done.clear()  # submit() computes inline: nothing is running, only unread results
