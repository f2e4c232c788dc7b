"""`LLM(data_parallel_size=N)`'s engine: the N replicas of core/data_parallel.py driven from synchronous code.

The replicas' client runs on an event loop in a thread of its own; `run()` submits a call's requests to it
and yields each one's final output as it finishes, so `LLM.generate` / `generate_unordered` keep their
behaviour (input order, errors per request, a progress bar, leaving early aborts the rest).
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from typing import Any

from tdpipe.config import EngineConfig
from tdpipe.core.data_parallel import DataParallelClient
from tdpipe.outputs import CompletionOutput, RequestOutput
from tdpipe.sampling.params import SamplingParams

__all__ = ["ReplicaRunner"]

# (index in the call, request id, prompt text or None, prompt token ids or None, params)
Job = tuple[int, str, str | None, list[int] | None, SamplingParams]


class ReplicaRunner:
    def __init__(self, config: EngineConfig) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tdpipe-replicas", daemon=True)
        self._thread.start()
        self.weight_version = 0
        self.closed = False
        try:
            self.client: DataParallelClient = self._call(DataParallelClient.start(config))
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    @property
    def default_sampling(self) -> dict[str, Any]:
        return self.client.default_sampling

    def run(self, jobs: list[Job]) -> Iterator[tuple[int, RequestOutput]]:
        """Every job's final output, as each finishes; a job the frontend refuses (validation) comes back with
        finish_reason "error", as LLMEngine's refusals do. Closing the iterator early aborts the rest."""
        done: queue.Queue = queue.Queue()

        async def one(job: Job) -> None:
            i, rid, text, ids, params = job
            try:
                req = self.client.request(text if ids is None else ids, params, rid, text)
                ids = req.prompt_token_ids
            except ValueError as e:
                done.put((i, RequestOutput(rid, text, list(ids or []), [CompletionOutput(0, "", [], "error")],
                                           error=str(e)), None))
                return
            last = None
            try:
                async for out in self.client.generate(req):
                    last = out
            except Exception as e:  # noqa: BLE001 - a dead replica: raised in the caller's thread
                done.put((i, None, e))
                return
            done.put((i, last, None))

        async def every() -> None:
            await asyncio.gather(*(one(j) for j in jobs))

        fut = asyncio.run_coroutine_threadsafe(every(), self._loop)
        try:
            for _ in jobs:
                i, out, err = done.get()
                if err is not None:
                    raise err
                out.weight_version = self.weight_version
                yield i, out
        finally:
            if not fut.done():  # left early or interrupted: the generators close, which aborts in the cores
                fut.cancel()

    def update_weights(self, folder: str) -> int:
        self.weight_version = self._call(self.client.update_weights_from_disk(folder))
        return self.weight_version

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._call(self.client.shutdown(grace_s=0))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
