"""`tdpipe run-batch -i batch.jsonl -o results.jsonl [engine flags]`: an OpenAI Batch file through the engine.

The requests go through the OpenAI server's own app (build_app), in this process, over httpx's ASGI transport:
no port, and each request is validated and answered exactly as `tdpipe serve` would answer it (same error
bodies, same usage). Many run at once (--max-concurrency) so the engine batches them; each result is appended
as one whole line the moment it finishes, so a crash or `kill -9` loses nothing finished, and running the same
command again answers only the rest (batch_file.py has the format and the resume rules).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

from tdpipe import aio
from tdpipe.engine_args import EngineArgs
from tdpipe.entrypoints.batch_file import BatchLine, BatchSink, error_record, parse_batch, response_record
from tdpipe.entrypoints.openai.serve_args import ServerConfig, add_answer_flags, answer_settings
from tdpipe.entrypoints.preflight import PreflightError, check_model, check_readable, check_writable

CONCURRENCY_PER_SEQ = 2  # default --max-concurrency = this x max_num_seqs: a full batch and as many queued
BUSY_RETRY_S = 0.5  # a 503 "server busy" (admission) is retried after this long


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run-batch", help="run an OpenAI Batch file (JSONL) through the engine; resumable",
        description="Run every request of an OpenAI Batch input file ({'custom_id', 'method': "
                    "'POST', 'url': '/v1/completions' or '/v1/chat/completions', 'body'} per line) and write "
                    "one line per request ({'id', 'custom_id', 'response': {'status_code', 'request_id', "
                    "'body'}, 'error'}), as `vllm run-batch` does. Requests are answered exactly as `tdpipe "
                    "serve` answers them. Each result is appended as it finishes; after a crash, kill -9 or "
                    "Ctrl-C, run the same command again and it answers only the custom_ids not yet in the "
                    "output. Exit code 0 when every request succeeded, 1 when any failed (its line has an "
                    "error or a status other than 200) or the engine died, 2 for a usage error, 130 when "
                    "interrupted. See docs/run-batch.md.")
    g = p.add_argument_group("batch")
    g.add_argument("-i", "--input-file", "--input", dest="input_file", required=True, metavar="FILE",
                   help="the batch input file (JSONL)")
    g.add_argument("-o", "--output-file", "--output", dest="output_file", required=True, metavar="FILE",
                   help="the results file (JSONL); appended to, so a second run resumes a first")
    g.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help=f"requests in flight at once (default: {CONCURRENCY_PER_SEQ} x --max-num-seqs, so "
                        "the engine always has a full batch and a queue behind it)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name a body's 'model' must match (default: the model folder's name; a "
                        "body without 'model' always matches)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_answer_flags(p.add_argument_group("answers (as `tdpipe serve` shapes them)"))
    EngineArgs.add_cli_args(p)
    p.set_defaults(fn=cmd_run_batch)


def cmd_run_batch(a: argparse.Namespace) -> int:
    check_readable(a.input_file, "--input-file")
    check_writable(a.output_file, "--output-file")
    check_writable(a.trace, "--trace")
    check_writable(a.record_history, "--record-history")
    if os.path.exists(a.output_file) and os.path.samefile(a.input_file, a.output_file):
        raise PreflightError("--output-file is the input file; give the results their own file")
    check_model(a.model)  # before a line is written
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise PreflightError(f"--max-concurrency must be >= 1, got {a.max_concurrency}")
    ecfg = EngineArgs.from_cli(a).create_engine_config()  # bad engine flags fail here, before anything is written
    try:  # so do the answer flags (--chat-template's file, --enable-auto-tool-choice without a parser)
        ServerConfig(**answer_settings(a))
    except ValueError as e:
        raise PreflightError(str(e)) from None
    from tdpipe.core.async_llm import AsyncLLM

    AsyncLLM.check_config(ecfg)
    with open(a.input_file, "rb") as f:
        lines = parse_batch(f.read())
    sink = BatchSink(a.output_file)
    sink.check_input(lines, a.input_file)
    total = len(lines)
    todo = [bl for bl in lines if bl.key not in sink.done]
    if sink.done:
        print(f"tdpipe: resuming: {len(sink.done)} of {total} already done in {a.output_file}",
              file=sys.stderr)
    with sink:
        bar = _progress(len(todo), a.no_progress)
        try:
            requests = write_unsendable(todo, sink, bar)
            outcome = Outcome()
            if requests:
                outcome = aio.run(_run(ecfg, requests, sink, bar, a))
        except KeyboardInterrupt:  # before the run's own handler was in place
            outcome = Outcome(signal=signal.SIGINT)
        except OSError as e:
            if not sink.write_failed:
                raise
            bar.close()
            print(f"tdpipe: error: writing {a.output_file} failed ({e.strerror or e}): {sink.total_done} of "
                  f"{total} done; run the same command again to resume", file=sys.stderr)
            return 1
        finally:
            bar.close()
    return _report(outcome, sink, total, a.output_file)


def write_unsendable(todo: list[BatchLine], sink: BatchSink, bar: Any) -> list[BatchLine]:
    """Answer the lines that need no engine (bad lines, refused bodies) first, so a failed start costs none of
    them; returns the requests left to send."""
    for bl in todo:
        if bl.error is not None or bl.refusal is not None:
            sink.write(error_record(bl))
            bar.update(1)
    return [bl for bl in todo if bl.error is None and bl.refusal is None]


def _progress(total: int, disabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="run-batch", disable=disabled or not total, file=sys.stderr,
                dynamic_ncols=True)


@dataclass
class Outcome:
    """How a run ended: normally, by a signal (SIGINT/SIGTERM) or with the engine dead."""

    signal: int | None = None
    dead: str | None = None
    failed_start: str | None = None
    unanswered: list[str] = field(default_factory=list)  # custom_ids answered 503 while the engine lived


def _report(o: Outcome, sink: BatchSink, total: int, path: str) -> int:
    done = sink.total_done
    resume = f"{done} of {total} done in {path}; run the same command again to resume"
    if o.signal is not None:
        print(f"tdpipe: interrupted: {resume}", file=sys.stderr)
        return 130 if o.signal == signal.SIGINT else 128 + o.signal
    if o.failed_start is not None:
        print(f"tdpipe: error: the engine did not start ({o.failed_start}): {resume}", file=sys.stderr)
        return 1
    if o.dead is not None:
        print(f"tdpipe: the engine died ({o.dead}): {resume}", file=sys.stderr)
        return 1
    if o.unanswered:
        print(f"tdpipe: {len(o.unanswered)} requests got no answer (the engine aborted them, e.g. "
              f"{o.unanswered[0]!r}): {resume}", file=sys.stderr)
        return 1
    failed = sink.total_failed
    print(f"tdpipe: {done} of {total} done in {path}" + (f"; {failed} failed (an 'error', or a "
          "response.status_code other than 200)" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


async def _run(ecfg: Any, requests: list[BatchLine], sink: BatchSink, bar: Any,
               a: argparse.Namespace) -> Outcome:
    """Start the engine, answer `requests`, stop the engine. SIGINT/SIGTERM stop it early (a second one exits
    at once: every line written so far is whole, and the engine core exits when it sees this process gone)."""
    from tdpipe.core.data_parallel import start_engine_client

    outcome = Outcome()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if outcome.signal is not None:
            print(f"tdpipe: interrupted again: {sink.total_done} lines are in {a.output_file}; exiting now",
                  file=sys.stderr)
            os._exit(130 if signum == signal.SIGINT else 128 + signum)
        outcome.signal = signum
        stop.set()

    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, on_signal, s)
    quiet = _QuietDeath()
    logging.getLogger("tdpipe").addFilter(quiet)  # the engine's death is reported once, by _report
    try:
        start = asyncio.ensure_future(start_engine_client(ecfg))  # AsyncLLM, or N replicas
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # interrupted while the model loads; the core exits once it sees us gone
            start.cancel()
            await asyncio.gather(start, stopped, return_exceptions=True)
            return outcome
        stopped.cancel()
        try:
            llm = start.result()
        except RuntimeError as e:  # EngineDeadError: it failed to start
            outcome.failed_start = str(e)
            return outcome
        try:
            await BatchRunner(llm, sink, bar, stop, outcome, a.served_model_name,
                              a.max_concurrency or CONCURRENCY_PER_SEQ * llm.max_num_seqs,
                              answer_settings(a)).run(requests)
        finally:
            await llm.shutdown(grace_s=0)
        return outcome
    finally:
        logging.getLogger("tdpipe").removeFilter(quiet)
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(s)


class _QuietDeath(logging.Filter):
    """Drops AsyncLLM's own log line when its core dies: run-batch says it once, with what to do next."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.funcName != "_die"


class BatchRunner:
    """Sends the requests through the server app, `concurrency` at a time, and writes each answer as it comes.
    A 503 is never written: "engine dead" stops the run (a rerun sends those requests again), "busy" is
    retried, an abort is left unanswered (and reported)."""

    def __init__(self, llm: Any, sink: BatchSink, bar: Any, stop: asyncio.Event, outcome: Outcome,
                 served_model_name: str | None, concurrency: int, answers: dict[str, Any] | None = None) -> None:
        """`answers`: ServerConfig keywords of the answer-shaping flags (serve_args.answer_settings)."""
        self.llm = llm
        self.sink = sink
        self.bar = bar
        self.stop = stop
        self.outcome = outcome
        self.served_model_name = served_model_name
        self.answers = answers or {}
        self.concurrency = concurrency

    def app(self) -> Any:
        from tdpipe.entrypoints.openai.api_server import build_app

        limit = max(ServerConfig.max_waiting_requests, self.concurrency)  # admission never refuses our own
        return build_app(self.llm, ServerConfig(served_model_name=self.served_model_name,
                                                max_waiting_requests=limit, access_log=False, **self.answers))

    async def run(self, requests: list[BatchLine]) -> None:
        import httpx

        transport = httpx.ASGITransport(app=self.app(), raise_app_exceptions=False)  # a 500 is an answer
        pending = iter(requests)
        async with httpx.AsyncClient(transport=transport, base_url="http://tdpipe", timeout=None) as client:
            workers = [asyncio.ensure_future(self._worker(client, pending))
                       for _ in range(min(self.concurrency, len(requests)))]
            stopped = asyncio.ensure_future(self.stop.wait())
            finished = asyncio.gather(*workers)  # ends when all are done, or at the first that raises
            try:
                await asyncio.wait({stopped, finished}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (*workers, stopped):
                    t.cancel()  # a request cancelled mid-flight aborts in the engine and is not written
                await asyncio.gather(*workers, stopped, finished, return_exceptions=True)
        for t in workers:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]

    async def _worker(self, client: Any, pending: Any) -> None:
        for bl in pending:
            if self.stop.is_set():
                return
            rec = await self._answer(client, bl)
            if rec is not None:  # a finished answer is written even when the run is stopping
                self.sink.write(rec)
                self.bar.update(1)

    async def _answer(self, client: Any, bl: BatchLine) -> dict | None:
        content = json.dumps(bl.body, ensure_ascii=False).encode()
        while True:
            r = await client.post(bl.url, content=content, headers={"content-type": "application/json"})
            try:
                body = r.json()
            except ValueError:
                body = {"error": {"message": r.text or f"HTTP {r.status_code}",
                                  "type": "internal_server_error", "param": None, "code": None}}
            if r.status_code != 503:
                return response_record(bl.custom_id or "", r.status_code, body)
            if self.llm.dead_reason is not None:
                if self.outcome.dead is None:
                    self.outcome.dead = self.llm.death_detail or self.llm.dead_reason  # the log's words
                self.stop.set()
                return None
            code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None
            if code == "server_busy":
                await asyncio.sleep(BUSY_RETRY_S)
                continue
            self.outcome.unanswered.append(bl.custom_id or "")
            return None


__all__ = ["BatchRunner", "Outcome", "add_parser", "cmd_run_batch", "write_unsendable"]
