"""AsyncLLM: the frontend's handle on an engine core running in its own process (gLLM §3.3).

The frontend process tokenises, detokenises and applies stop strings (core/output_processor.py); the core
process (core/engine_core.py) schedules and runs the model in token ids. They talk over ZeroMQ, so HTTP
parsing, tokenising and streaming never take time from the loop that keeps the pipeline full.

`generate()` is an async iterator per request; leaving it early (a client that hung up) aborts the request in
the core, which frees its KV blocks at its next step. Each request has one output slot, not a queue
(core/output_collector.py): a reader that stops reading holds one output, however long the request runs.
Requests are validated by core/validation.py, the same function the OpenAI server calls. If the core
process dies, every open request raises EngineDeadError, `dead_reason` says why (client-safe text) and
`wait_dead()` returns. AsyncLLM satisfies core/engine_client.py's EngineClient.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from typing import Any

from tdpipe.config import EngineConfig
from tdpipe.core import engine_core as core
from tdpipe.core.engine_client import EngineDeadError, as_engine_request
from tdpipe.core.output_collector import RequestOutputCollector
from tdpipe.core.output_kind import OutputKindFilter
from tdpipe.core.output_processor import OutputProcessor
from tdpipe.core.validation import EngineRequest, RequestLimits, validate_request
from tdpipe.outputs import RequestOutput
from tdpipe.sampling.params import SamplingParams
from tdpipe.tokenizer import require_unicode

__all__ = ["AsyncLLM", "EngineDeadError"]

log = logging.getLogger("tdpipe")


class AsyncLLM:
    def __init__(self, config: EngineConfig, cpus: list[int] | None = None) -> None:
        """`cpus`: the cores the engine core (and its stages) may run on; None: this process's."""
        self.check_config(config)
        self.config = config
        self.cpus = cpus
        self.tokenizer: Any = None
        self.default_sampling: dict[str, Any] = {}
        self.eos_token_ids: frozenset[int] = frozenset()
        self.model_name = ""
        self.max_model_len = 0
        self.max_num_seqs = 0
        self.vocab_size = 0
        self.ready = False
        self.dead_reason: str | None = None  # client-safe: never the core's exception text
        self.death_detail: str | None = None  # what the log says (the core's own words)
        self.failed_on_death = 0  # requests open when the core died
        self.log_death = True  # False: the caller reports the death itself (tdpipe serve)
        self._dead = asyncio.Event()
        self._stats: dict[str, Any] = {}
        self._collectors: dict[str, RequestOutputCollector] = {}
        self.processor = OutputProcessor(None, stream=True)  # with the model's tokenizer once started
        self._proc: subprocess.Popen | None = None
        self._pidfd = -1
        self._dir = ""
        self._tasks: list[asyncio.Task] = []
        self._updates: dict[int, asyncio.Future] = {}  # weight updates waiting for the core's answer
        self._update_ids = itertools.count()

    # -- life cycle --------------------------------------------------------------------------------------
    @staticmethod
    def check_config(config: EngineConfig) -> None:
        """What this frontend cannot run (the server and run-batch call it before they start anything)."""
        if getattr(config, "skip_tokenizer_init", False):  # the frontend tokenizes, detokenizes, templates
            raise ValueError("skip_tokenizer_init runs offline only (LLM): the server, run-batch and AsyncLLM "
                             "need the model's tokenizer")

    @classmethod
    async def start(cls, config: EngineConfig) -> "AsyncLLM":
        """Start the core process and return once its model is loaded (raises EngineDeadError if it fails)."""
        self = cls(config)
        await self._start()
        return self

    async def _start(self) -> None:
        import zmq
        import zmq.asyncio

        self._dir = tempfile.mkdtemp(prefix="tdpipe-ipc-")  # 0700: only this user reaches the sockets
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(out_addr)
        with open(f"{self._dir}/config.pkl", "wb") as f:
            pickle.dump(self.config, f)
        # a fresh interpreter (`python -m`), not multiprocessing's spawn: that re-imports the caller's
        # __main__, which runs a script without an `if __name__ == "__main__"` guard a second time
        env = None if self.cpus is None else {**os.environ, core.CPUS_ENV: ",".join(map(str, self.cpus))}
        self._proc = subprocess.Popen([sys.executable, "-m", "tdpipe.core.engine_core", f"{self._dir}/config.pkl",
                                       in_addr, out_addr, str(os.getpid())], env=env)
        self._pidfd = os.pidfd_open(self._proc.pid)  # readable once the process exits
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        loop.add_reader(self._pidfd, self._on_exit)
        early = self._early_tokenizer(loop)
        recv = asyncio.ensure_future(self._pull.recv())
        done, _ = await asyncio.wait([recv, self._exited], return_when=asyncio.FIRST_COMPLETED)
        if recv not in done:
            if early is not None:
                early[1].cancel()  # its thread ends on its own; nobody waits for it
            recv.cancel()
            self._proc = None
            self._close_pidfd()
            await self._close_sockets()
            raise EngineDeadError(self.death_detail or "the engine core exited during start-up")
        msg = pickle.loads(recv.result())
        if msg[0] != core.READY:
            if early is not None:
                early[1].cancel()
            await self._stop_process()
            raise EngineDeadError(msg[1] if msg[0] == core.DEAD else f"unexpected message {msg[0]!r} at start-up")
        info: core.CoreInfo = msg[1]
        self.tokenizer = await self._tokenizer_of(self.config.tokenizer or info.model_path, early)
        self.model_name = os.path.basename(os.path.normpath(info.model_path))
        self.max_model_len, self.max_num_seqs, self.vocab_size = info.max_model_len, info.max_num_seqs, info.vocab_size
        self.default_sampling = info.default_sampling
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self._stats = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "num_blocks": info.num_blocks,
                       "num_free_blocks": info.num_blocks, "num_preemptions": 0, "prompt_tokens": 0,
                       "generation_tokens": 0, "stage_busy": [0.0] * info.pp}
        self.processor = OutputProcessor(self.tokenizer, stream=True)
        self._tasks.append(asyncio.create_task(self._read_outputs()))
        self.ready = True

    def _early_tokenizer(self, loop: asyncio.AbstractEventLoop) -> tuple[str, asyncio.Future] | None:
        """Load the tokenizer on a thread while the core starts (about a second of every start-up), from
        --tokenizer's folder, or the folder the model resolves to where that needs no conversion
        (model/bundled.py)."""
        from tdpipe.model.bundled import resolved_model
        from tdpipe.tokenizer import load_tokenizer

        path = self.config.tokenizer or resolved_model(self.config.model, self.config.dtype)
        return None if path is None else (path, loop.run_in_executor(None, load_tokenizer, path))

    @staticmethod
    async def _tokenizer_of(model_path: str, early: tuple[str, asyncio.Future] | None) -> Any:
        """The tokenizer of `model_path` (the folder the core loaded, or --tokenizer's): the early one where it
        came from that folder."""
        from tdpipe.tokenizer import load_tokenizer

        if early is not None:
            path, future = early
            if path != model_path:  # the core chose another folder: not waited for
                future.cancel()
            else:
                try:
                    return await future
                except Exception:  # noqa: BLE001 - loaded again below, where a damaged file gets its one-line error
                    pass
        return load_tokenizer(model_path)

    def _on_exit(self) -> None:
        """The core process ended (the sentinel fd became readable)."""
        proc = self._proc
        if proc is None:
            return
        self._close_pidfd()
        if not self._exited.done():
            self._exited.set_result(None)
        if self.dead_reason is None:
            code = proc.wait()
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            self._die(f"the engine core process {how}")

    async def wait_dead(self) -> str:
        """Return (dead_reason) once the core has died; never while it runs."""
        await self._dead.wait()
        return self.dead_reason or "the engine core died"

    def _close_pidfd(self) -> None:
        if self._pidfd >= 0:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    def _die(self, reason: str, detail: str | None = None) -> None:
        """Fail every open request with `reason` (shown to clients); `detail` (the core's exception text, for
        the log only) is logged once, with the reason."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self.death_detail = detail or reason
        self.ready = False
        self.failed_on_death = len(self._collectors)
        if self.log_death:
            log.error("%s", self.death_detail)
        for c in self._collectors.values():
            c.fail(EngineDeadError(reason))
        self._dead.set()

    def check_health(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self.ready:
            raise EngineDeadError("the engine is not running")

    def stats(self) -> dict[str, Any]:
        """The core's latest snapshot (refreshed every step, once a second when idle), no round trip, with
        what this side knows at once: open requests (num_requests) and those unfinished in the core."""
        return self._stats | {"num_requests": len(self._collectors), "num_unfinished": len(self.processor.requests)}

    # -- requests ----------------------------------------------------------------------------------------
    def _send(self, *msg: Any) -> None:
        self._push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                text: str | None = None) -> EngineRequest:
        """A raw prompt (text: tokenised with special tokens) validated into an EngineRequest
        (core/validation.py; RequestError, a ValueError naming the field, if refused). `text`: the text of a
        prompt given as token ids (a chat template's), kept for the outputs."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(require_unicode(prompt, "prompt"), add_special_tokens=True)
        else:
            ids = list(prompt)
        return validate_request(request_id, ids, params, RequestLimits.of(self), text)

    async def generate(self, prompt: EngineRequest | str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's RequestOutput each time it advances (a slow reader skips to the newest); the
        last one has finished=True. What each holds follows params.output_kind (vLLM's): the output so far
        (CUMULATIVE, the default), only what is new (DELTA), or the finished output alone (FINAL_ONLY). An
        EngineRequest (validated by the caller) runs as it is; a raw prompt is validated first. Raises
        ValueError before the first output for a request the engine refuses."""
        self.check_health()
        req = as_engine_request(prompt, params, request_id, self.request)
        rid = req.request_id
        if rid in self._collectors:
            raise ValueError(f"request_id {rid!r} is already running")
        state = self.processor.add_request(rid, req.prompt, req.prompt_token_ids, req.params)
        collector = RequestOutputCollector(lambda: self._stamped(self.processor.render(state)))
        self._collectors[rid] = collector
        kind = OutputKindFilter(req.params.output_kind)
        finished = False
        try:
            self._send(core.ADD, rid, req.prompt_token_ids, req.params, req.prompt)
            while True:
                try:
                    out = await collector.get()
                except asyncio.CancelledError:
                    raise  # the caller left: the finally aborts the request
                except BaseException:
                    finished = True  # refused, or the core is gone: nothing to abort
                    raise
                finished = out.finished
                shown = kind(out)
                if shown is not None:
                    yield shown
                if finished:
                    return
        finally:
            self._collectors.pop(rid, None)
            if not finished:  # the caller left early (disconnect, cancel): the core frees its blocks
                self.processor.abort(rid)
                if self.dead_reason is None:
                    self._send(core.ABORT, [rid], "abort")

    def _stamped(self, out: RequestOutput) -> RequestOutput:
        """The output with the weight version the core last reported (each step's stats carry it)."""
        out.weight_version = self._stats.get("weight_version", 0)
        return out

    async def abort(self, request_id: str) -> None:
        """Finish a request with finish_reason "abort"; its iterator yields that output and ends."""
        if self.processor.abort(request_id) is None:
            return
        if self.dead_reason is None:
            self._send(core.ABORT, [request_id], "abort")
        if (c := self._collectors.get(request_id)) is not None:
            c.notify()

    def _on_message(self, msg: tuple) -> None:
        """One message from the core: a step's deltas and stats, a refused request, or its death."""
        if msg[0] == core.OUT:
            _, deltas, stats = msg
            self._stats = stats
            touched, stopped = self.processor.advance(deltas)
            if stopped:
                self._send(core.ABORT, stopped, "stop")
            for st in touched:
                if (c := self._collectors.get(st.request_id)) is not None:
                    c.notify()
        elif msg[0] == core.REJECTED:
            _, rid, err = msg
            self.processor.abort(rid)
            if (c := self._collectors.get(rid)) is not None:
                c.fail(ValueError(err))
        elif msg[0] == core.UPDATED:
            _, call, version, err = msg
            if (fut := self._updates.pop(call, None)) is not None and not fut.done():
                fut.set_result(version) if err is None else fut.set_exception(ValueError(err))
        elif msg[0] == core.DEAD:
            self._die("the engine core failed", msg[1])

    async def update_weights_from_disk(self, model_path: str, in_flight: str = "finish") -> int:
        """New weights from a checkpoint folder (core/weight_sync.py), without a restart, the prefix cache
        emptied. `in_flight`: "finish": requests in flight finish on the old weights, requests that arrive
        meanwhile wait and run on the new ones; "recompute": the running requests are paused at once and
        recomputed (prompt and outputs so far) on the new weights. Returns the new weight version;
        ValueError for a folder the engine refuses."""
        if in_flight not in core.IN_FLIGHT_MODES:
            raise ValueError(f"in_flight must be one of {', '.join(core.IN_FLIGHT_MODES)}, got {in_flight!r}")
        self.check_health()
        call = next(self._update_ids)
        fut = asyncio.get_running_loop().create_future()
        self._updates[call] = fut
        self._send(core.UPDATE, call, model_path, in_flight)
        dead = asyncio.ensure_future(self._dead.wait())
        try:
            done, _ = await asyncio.wait([fut, dead], return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
        if fut not in done:
            self._updates.pop(call, None)
            raise EngineDeadError(self.dead_reason or "the engine core is gone")
        return fut.result()

    async def _read_outputs(self) -> None:
        try:
            while True:
                self._on_message(pickle.loads(await self._pull.recv()))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken socket is a dead engine for every request
            self._die("lost the connection to the engine core", f"lost the engine core: {e}")

    # -- shutdown ----------------------------------------------------------------------------------------
    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Let open requests finish for up to grace_s seconds, abort the rest, stop the core process and its
        stages (killed if they do not stop in time). Idempotent."""
        if self._proc is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._collectors and self.dead_reason is None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._collectors):
            await self.abort(rid)
        await asyncio.sleep(0)  # let the iterators see their final output
        await self._stop_process()

    async def _stop_process(self) -> None:
        proc, self._proc = self._proc, None
        self._close_pidfd()
        self.ready = False
        if self.dead_reason is None:
            self.dead_reason = "the engine was shut down"
        if proc is not None and proc.poll() is None:
            try:
                self._send(core.SHUTDOWN)
            except Exception:  # noqa: BLE001
                pass
            for _ in range(150):  # the stages get a few seconds to stop (pipeline/executor.py)
                if proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            if proc.poll() is None:
                proc.terminate()
                await asyncio.sleep(2)
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
        for t in self._tasks:
            t.cancel()
        await self._close_sockets()

    async def _close_sockets(self) -> None:
        for s in (getattr(self, "_push", None), getattr(self, "_pull", None)):
            if s is not None:
                s.close(linger=0)
        if getattr(self, "_ctx", None) is not None:
            self._ctx.term()
            self._ctx = None
        shutil.rmtree(self._dir, ignore_errors=True)
