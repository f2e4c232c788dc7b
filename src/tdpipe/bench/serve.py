"""`tdpipe bench serve`: online serving latency and goodput against request rate (vLLM's benchmark_serving,
gLLM §4.1 / Fig. 10, the lecture's §4.1 TTFT / TPOT / goodput).

Requests go through the real `openai` async client to an OpenAI-compatible server (streaming, with
`stream_options.include_usage`), arriving as a Poisson process at `--request-rate` req/s ("inf": all at
once), optionally capped at `--max-concurrency` in flight. Every request is greedy, `ignore_eos` (vLLM's
extra field) and `max_tokens` = its workload output length, on the same workloads as `tdpipe bench
throughput` (same flags, same seed, same prompts), so the two benches measure the same work.

Per request (times on the client, from the moment the request is sent; with --max-concurrency the wait for a
free slot is not counted, as in vLLM):
  - TTFT = first streamed token chunk - send time;
  - E2E  = end of the stream - send time;
  - TPOT = (E2E - TTFT) / (output_tokens - 1), output_tokens from the server's `usage` (not chunk counts);
    undefined for a one-token output;
  - ITL  = every gap between consecutive token chunks (a chunk that carries several tokens is one gap).
Per rate: mean / p50 / p90 / p99 of each; request, output and total token throughput over the rate's wall
time (first send to last completion); goodput = requests/s that met every SLO given (--slo-ttft, --slo-tpot
in ms; a failed request meets none) and SLO attainment = the fraction of all requests that met them (gLLM
Fig. 14).

`--launch` starts `tdpipe serve` itself (engine flags after `--`), waits for GET /health, runs the sweep, and
stops it with SIGTERM, checking that it exited 0 and left no process of its group behind.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.util
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from tdpipe import aio
from tdpipe.bench import workload as wl
from tdpipe.bench.machine import describe as describe_machine
from tdpipe.viz.latency import FORMAT, load_runs, plot_latency

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
PERCENTILES = (50, 90, 99)
WARMUP_PROMPT_TOKENS = 16  # the warm-up request: a short cut of the first prompt, 2 output tokens
WARMUP_OUTPUT_TOKENS = 2
# the arrival process is seeded with the workload seed plus this: arrivals and prompts are independent draws
ARRIVAL_SEED_OFFSET = 1


# -- configuration -------------------------------------------------------------------------------------
@dataclass
class LaunchConfig:
    """How `--launch` runs the server. The server's output goes to a log file, never into the table."""

    command: list[str]  # the program, without --host/--port and the engine flags
    serve_args: list[str]  # engine flags for `tdpipe serve` (given after --)
    startup_timeout_s: float = 900.0  # model load, kernel build and (td-pipe) step profiling on a cold cache
    shutdown_timeout_s: float = 120.0  # the server's own grace period plus stopping its stage processes
    log_path: str | None = None  # None: a temporary file, named in the report


@dataclass
class RequestSpec:
    """One request as sent: the prompt in the form the endpoint takes, and its forced output length."""

    prompt: list[int] | str
    output_len: int


@dataclass
class RequestResult:
    """What the client saw of one request. Times in seconds."""

    ok: bool
    output_len: int  # asked for (max_tokens)
    prompt_tokens: int = 0  # from usage
    output_tokens: int = 0  # from usage
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None when there is no second token to time."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class SLO:
    """Latency objectives in milliseconds; None: no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, r: RequestResult) -> bool:
        """A request meets the SLOs when it succeeded and each given objective holds (a one-token output
        has no TPOT and cannot miss a TPOT objective)."""
        if not r.ok or r.ttft is None:
            return False
        if self.ttft_ms is not None and 1e3 * r.ttft > self.ttft_ms:
            return False
        tpot = r.tpot
        return not (self.tpot_ms is not None and tpot is not None and 1e3 * tpot > self.tpot_ms)


# -- metrics -------------------------------------------------------------------------------------------
def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 in milliseconds (numpy's linear interpolation, as vLLM reports them); None
    for each when there are no values (every request failed, or all outputs were one token)."""
    keys = ["mean"] + [f"p{q}" for q in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    a = 1e3 * np.asarray(values_s, dtype=np.float64)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}}


def cpu_snapshot() -> tuple[float, float]:
    """(this process's CPU seconds, the whole machine's busy CPU seconds from /proc/stat; 0 where unreadable).
    The difference over a rate is what the server (and anything else running) used: with the client on the
    same machine, its CPU is taken from the engine's."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    machine = 0.0
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        machine = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return ru.ru_utime + ru.ru_stime, machine


def cpu_since(before: tuple[float, float], duration_s: float) -> dict[str, float]:
    client0, machine0 = before
    client1, machine1 = cpu_snapshot()
    client, machine = client1 - client0, machine1 - machine0
    return {"client_s": client, "machine_busy_s": machine, "server_and_rest_s": max(0.0, machine - client),
            "client_share": client / machine if machine > 0 else 0.0, "wall_s": duration_s}


def rate_metrics(results: list[RequestResult], duration_s: float, slo: SLO) -> dict[str, Any]:
    """The numbers of one request rate: counts, throughput, latency distributions, goodput."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    in_tok = sum(r.prompt_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    good = sum(1 for r in results if slo.met(r)) if slo.given else None
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "output_len_mismatch": sum(1 for r in ok if r.output_tokens != r.output_len),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tok / duration_s,
        "total_token_throughput": (in_tok + out_tok) / duration_s,
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itl]),
        "e2e_ms": distribution_ms([r.e2e for r in ok if r.e2e is not None]),
        "goodput": None if good is None else {
            "slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms, "good_requests": good,
            "requests_per_s": good / duration_s, "attainment": good / len(results) if results else 0.0},
        # every request's TTFT and TPOT (None: failed, or one output token), so goodput can be recomputed
        # offline under other SLOs (scripts/pd/goodput.py)
        "per_request": {"ttft_ms": [_ms(r.ttft) if r.ok else None for r in results],
                        "tpot_ms": [_ms(r.tpot) if r.ok else None for r in results]},
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 3)


# -- arrivals ------------------------------------------------------------------------------------------
def parse_rates(text: str) -> list[float]:
    """'0.5,1,2,inf' -> [0.5, 1.0, 2.0, inf]; every rate > 0 (inf: every request at once)."""
    rates = []
    for part in text.split(","):
        s = part.strip().lower()
        try:
            r = math.inf if s in ("inf", "infinity") else float(s)
        except ValueError:
            raise ValueError(f"--request-rate {text!r}: {part.strip()!r} is not a number or 'inf'") from None
        if not (r > 0) or math.isnan(r):
            raise ValueError(f"--request-rate {text!r}: every rate must be > 0 (or 'inf'), "
                             f"got {part.strip()!r}")
        rates.append(r)
    return rates


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process (exponential gaps of mean 1/rate), the first
    request at 0; all 0 for an infinite rate."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# -- one request ---------------------------------------------------------------------------------------
def _is_token_chunk(choice: Any, chat: bool) -> bool:
    """Does this streamed choice carry generated output? A chat role announcement (role, empty content) and
    a bare end marker (empty text with a finish_reason) do not; a token that decoded to no text yet does."""
    if chat:
        delta = choice.delta
        text = getattr(delta, "content", None)
        if text is None:
            return False
        return bool(text) or (getattr(delta, "role", None) is None and choice.finish_reason is None)
    return bool(choice.text) or choice.finish_reason is None


async def send_request(client: Any, model: str, spec: RequestSpec, chat: bool,
                       stream: bool = True) -> RequestResult:
    """Stream one request and time it; every failure becomes a failed result with its message.
    stream=False (--no-stream) asks for the whole answer at once: TTFT is then the E2E latency."""
    res = RequestResult(ok=False, output_len=spec.output_len)
    common = dict(model=model, max_tokens=spec.output_len, temperature=0.0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = None
    start = time.perf_counter()
    last = start
    if not stream:
        del common["stream_options"]
        common["stream"] = False
        try:
            if chat:
                r = await client.chat.completions.create(messages=[{"role": "user", "content": spec.prompt}],
                                                         **common)
            else:
                r = await client.completions.create(prompt=spec.prompt, **common)
        except Exception as e:  # noqa: BLE001 - any client/server failure is this request's result
            res.error = (f"{type(e).__name__}: " + " ".join(str(e).split()))[:500]
            return res
        res.e2e = res.ttft = time.perf_counter() - start
        res.prompt_tokens, res.output_tokens = int(r.usage.prompt_tokens), int(r.usage.completion_tokens)
        res.ok = True
        return res
    try:
        if chat:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": spec.prompt}], **common)
        else:
            stream = await client.completions.create(prompt=spec.prompt, **common)
        async for chunk in stream:
            now = time.perf_counter()
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage
            if chunk.choices and _is_token_chunk(chunk.choices[0], chat):
                if res.ttft is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - any client/server failure is this request's result
        res.error = (f"{type(e).__name__}: " + " ".join(str(e).split()))[:500]
        return res
    if res.ttft is None:
        res.error = "the stream ended without a token"
    elif usage is None:
        res.error = "the stream carried no usage (stream_options.include_usage): output tokens unknown"
    else:
        res.prompt_tokens, res.output_tokens = int(usage.prompt_tokens), int(usage.completion_tokens)
        res.ok = True
    return res


async def run_rate(client: Any, model: str, specs: list[RequestSpec], rate: float,
                   max_concurrency: int | None, seed: int, chat: bool,
                   progress: bool, stream: bool = True) -> tuple[list[RequestResult], float]:
    """Send `specs` at their Poisson send times; returns the results in workload order and the wall time
    from the first send to the last completion."""
    from tqdm import tqdm

    offsets = arrival_offsets(len(specs), rate, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), desc=f"rate {rate_label(rate)}", unit="req", disable=not progress,
               file=sys.stderr)

    async def one(spec: RequestSpec) -> RequestResult:
        async with sem if sem is not None else contextlib.nullcontext():
            r = await send_request(client, model, spec, chat, stream)
        bar.update(1)
        return r

    tasks = []
    t0 = time.perf_counter()
    try:
        for spec, off in zip(specs, offsets):
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
    finally:
        for t in tasks:  # interrupted: nothing keeps streaming behind our back
            t.cancel()
        bar.close()
    return list(results), time.perf_counter() - t0


# -- the server ----------------------------------------------------------------------------------------
def server_root(base_url: str) -> str:
    """The server's root (where /health lives) from its OpenAI base URL: '.../v1' stripped."""
    u = base_url.rstrip("/")
    return u[: -len("/v1")] if u.endswith("/v1") else u


def host_port(base_url: str) -> tuple[str, int]:
    u = urlsplit(base_url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"--base-url {base_url!r}: expected http://HOST:PORT/v1")
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of `flag` in a list of command-line arguments ('--f v' or '--f=v'), the last one winning."""
    val = None
    for i, x in enumerate(args):
        if x == flag and i + 1 < len(args):
            val = args[i + 1]
        elif x.startswith(flag + "="):
            val = x.split("=", 1)[1]
    return val


def _listening(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _log_tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


class LaunchedServer:
    """A server process started by the bench, in its own process group so that it and every stage process
    under it can be checked (and, if they outlive a SIGTERM, killed) together."""

    def __init__(self, cfg: LaunchConfig, base_url: str, api_key: str | None) -> None:
        self.cfg = cfg
        self.base_url = base_url
        host, port = host_port(base_url)
        self.argv = [*cfg.command, "--host", host, "--port", str(port), *cfg.serve_args]
        if _listening(host, port):
            raise ValueError(f"--launch: something already listens on {host}:{port}; stop it or give another "
                             "port in --base-url")
        if cfg.log_path:
            self.log_path = cfg.log_path
        else:
            fd, self.log_path = tempfile.mkstemp(prefix="tdpipe-bench-serve-", suffix=".log")
            os.close(fd)
        env = dict(os.environ)
        if api_key:  # through the environment, not the command line (other users can read argv)
            env["TDPIPE_API_KEY"] = api_key
        self._log = open(self.log_path, "w")
        print(f"launching: {shlex.join(self.argv)} (log: {self.log_path})", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.exit_code: int | None = None
        self.stop_s: float | None = None
        self.problem: str | None = None

    def wait_ready(self) -> float:
        """Poll GET /health until 200; fail with the log's tail if the server exits or never gets ready."""
        import httpx

        url = server_root(self.base_url) + "/health"
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ValueError(f"--launch: the server exited with code {self.proc.returncode} before it "
                                 f"was ready; last lines of {self.log_path}:\n{_log_tail(self.log_path)}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.cfg.startup_timeout_s:
                raise ValueError(f"--launch: {url} not healthy after {self.cfg.startup_timeout_s:.0f} "
                                 f"s; last lines of {self.log_path}:\n{_log_tail(self.log_path)}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM, wait for the exit, then check its process group is empty; anything left is killed and
        recorded as a problem (the server must stop its stages itself)."""
        t0 = time.monotonic()
        pid = self.proc.pid
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=self.cfg.shutdown_timeout_s)
                except subprocess.TimeoutExpired:
                    self.problem = (f"did not exit within {self.cfg.shutdown_timeout_s:.0f} s of SIGTERM "
                                    "(killed)")
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                    self.proc.wait()
            self.exit_code = self.proc.returncode
            self.stop_s = time.monotonic() - t0
            if self.problem is None and self.exit_code != 0:
                self.problem = f"exited with code {self.exit_code} after SIGTERM"
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return  # nothing of the group is left
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            left = "processes of its group outlived it (killed)"
            self.problem = left if self.problem is None else f"{self.problem}; {left}"
        finally:
            self._log.close()

    def record(self) -> dict[str, Any]:
        return {"command": self.argv, "log": self.log_path, "exit_code": self.exit_code,
                "stop_s": self.stop_s, "clean_exit": self.problem is None, "problem": self.problem}


# -- CLI -----------------------------------------------------------------------------------------------
def add_parser(bsub: Any) -> argparse.ArgumentParser:
    p = bsub.add_parser(
        "serve", help="online serving: latency (TTFT, TPOT, ITL, E2E) and goodput against request rate",
        description="Drive an OpenAI-compatible server with the openai async client (streaming completions "
                    "or chat) under Poisson arrivals; report TTFT, TPOT, inter-token and end-to-end latency "
                    "(mean, p50, p90, p99), request and token throughput and goodput per request rate. Same "
                    "workloads as `tdpipe bench throughput` (greedy, ignore_eos, max_tokens = the workload's "
                    "output length). With --launch it starts `tdpipe serve` itself with the engine flags "
                    "given after --, e.g. `tdpipe bench serve --launch --request-rate 1,2,4 -- --scheduler "
                    "td-pipe --pp 2`.")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=DEFAULT_BASE_URL,
                   help=f"the server's OpenAI base URL ({DEFAULT_BASE_URL})")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="completions: /v1/completions with the prompt token ids (the exact prompts of bench "
                        "throughput); chat: /v1/chat/completions, the prompt as one user message (its text), "
                        "so the chat template adds tokens")
    g.add_argument("--api-key", default=None,
                   help="bearer key for the server (default: $TDPIPE_API_KEY); with --launch the server gets "
                        "it too")
    g.add_argument("--served-model-name", default=None,
                   help="model name to request (default: the first of /v1/models)")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="seconds one request may take")
    g.add_argument("--launch", action="store_true",
                   help="start `tdpipe serve` on --base-url's host and port with the engine flags after -- "
                        "(or --serve-args), wait for /health, run, then stop it with SIGTERM and check it "
                        "exited")
    g.add_argument("--serve-args", default="",
                   help="engine flags for --launch as one string (added before those after --)")
    g.add_argument("--launch-command", default=None,
                   help="program --launch runs instead of `python -m tdpipe.cli serve` (it gets "
                        "--host, --port and the engine flags appended)")
    g.add_argument("--startup-timeout", type=float, default=LaunchConfig.startup_timeout_s,
                   help="--launch: seconds to wait for /health")
    g.add_argument("--shutdown-timeout", type=float, default=LaunchConfig.shutdown_timeout_s,
                   help="--launch: seconds the server may take to exit after SIGTERM before it is killed")
    g.add_argument("--server-log", default=None, metavar="FILE",
                   help="--launch: write the server's output here (default: a temporary file, named on "
                        "stderr)")
    g.add_argument("serve_args_rest", nargs="*", metavar="-- ENGINE_FLAGS",
                   help="engine flags for the launched `tdpipe serve` (after --)")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf",
                   help="requests/s of the Poisson arrivals, or a comma-separated sweep run in turn, e.g. "
                        "0.5,1,2,inf (inf: all at once; default inf)")
    g.add_argument("--no-stream", action="store_true",
                   help="ask for whole answers (stream=false): measures what streaming costs the server; TTFT "
                        "then equals E2E")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (a request waits for a slot; the wait is not in its "
                        "latency)")
    g.add_argument("--slo-ttft", type=float, default=None, metavar="MS",
                   help="TTFT objective for goodput, ms")
    g.add_argument("--slo-tpot", type=float, default=None, metavar="MS",
                   help="TPOT objective for goodput, ms")

    # the workload flags of `tdpipe bench throughput` (build_workload reads them), same names and defaults
    g = p.add_argument_group("workload (as in `tdpipe bench throughput`)")
    wl.add_workload_args(g, seed_help="seed of the synthetic workload and of the arrival times", short_seed=True)
    g.add_argument("--model", default=None,
                   help="local model folder or .gguf whose vocabulary and tokenizer build the prompts "
                        "(default: the --model in the engine flags, else the bundled model); no weights are "
                        "loaded")

    g = p.add_argument_group("output")
    g.add_argument("--label", default=None,
                   help="name of this run, e.g. the policy (default with --launch: '<scheduler> pp=<N>' from "
                        "the engine flags, else 'server'); one line per label in the plot")
    g.add_argument("--json", default=None, metavar="FILE",
                   help="write the results as JSON (after every rate)")
    g.add_argument("--append", action="store_true",
                   help="add this run to the runs already in --json (a run with the same label is replaced)")
    g.add_argument("--plot", default=None, metavar="PNG",
                   help="draw mean TTFT and TPOT against request rate, one line per label (every run in "
                        "--json)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(fn=run)
    return p


def _serve_args(a: argparse.Namespace) -> list[str]:
    return shlex.split(a.serve_args) + list(a.serve_args_rest)


def preflight(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every flag and path checked before a server starts or a request goes out. Returns the runs already in
    --json that --append keeps."""
    from tdpipe.entrypoints.preflight import PreflightError, check_model, check_readable, check_writable

    parse_rates(a.request_rate)
    host_port(a.base_url)
    if a.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {a.num_prompts}")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {a.max_concurrency}")
    for flag, v in (("--slo-ttft", a.slo_ttft), ("--slo-tpot", a.slo_tpot),
                    ("--request-timeout", a.request_timeout), ("--startup-timeout", a.startup_timeout),
                    ("--shutdown-timeout", a.shutdown_timeout)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"{flag} must be a positive number, got {v}")
    serve_args = _serve_args(a)
    if serve_args and not a.launch:
        raise ValueError(f"engine flags ({shlex.join(serve_args)}) are only for --launch; a running server "
                         "has its own")
    if not a.launch and (a.launch_command or a.server_log):
        raise ValueError("--launch-command and --server-log need --launch")
    for flag in ("--host", "--port"):
        if _flag_value(serve_args, flag) is not None:
            raise ValueError(f"{flag} after --: the launched server listens where --base-url says")
    if a.append and not a.json:
        raise ValueError("--append needs --json FILE")
    model = a.model or _flag_value(serve_args, "--model")
    check_model(model)
    check_readable(a.dataset, "--dataset")
    check_readable(a.history, "--history")
    check_writable(a.json, "--json")
    check_writable(a.plot, "--plot")
    check_writable(a.server_log, "--server-log")
    if a.append and os.path.exists(a.json) and os.path.getsize(a.json) > 0:
        try:
            return load_runs(a.json)
        except ValueError as e:
            raise PreflightError(f"--append --json {a.json}: {e}") from None
    return []


def default_label(a: argparse.Namespace) -> str:
    if a.label:
        return a.label
    if not a.launch:
        return "server"
    from tdpipe.config import ParallelConfig, SchedulerConfig

    args = _serve_args(a)
    if _flag_value(args, "--disaggregation") == "pd":  # prefill/decode instances (docs/disaggregation.md)
        return (f"pd P={_flag_value(args, '--prefill-workers') or ParallelConfig.prefill_workers} "
                f"D={_flag_value(args, '--decode-workers') or ParallelConfig.decode_workers}")
    pp = _flag_value(args, "--pp") or _flag_value(args, "--pipeline-parallel-size")
    return (f"{_flag_value(args, '--scheduler') or SchedulerConfig.policy} "
            f"pp={pp or ParallelConfig.pipeline_parallel_size}")


def _model_info(model: str | None) -> tuple[str, int, int]:
    """The local model folder, its vocabulary size and max_position_embeddings, read from config.json only:
    the prompts need the vocabulary, not the weights."""
    from tdpipe.model.bundled import resolve_model

    path = resolve_model(model)
    return (path, *wl.model_vocab(path))


class _LazyTokenizer:
    """The model's tokenizer, loaded on first use: synthetic token-id prompts never need it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tok: Any = None

    def get(self) -> Any:
        if self._tok is None:
            from tdpipe.tokenizer import load_tokenizer

            self._tok = load_tokenizer(self.path)
        return self._tok

    def __getattr__(self, name: str) -> Any:  # encode, apply_chat_template...: what the workload calls
        return getattr(self.get(), name)


def build_requests(a: argparse.Namespace, vocab_size: int, max_model_len: int,
                   tok: _LazyTokenizer) -> tuple[str, list[wl.BenchRequest]]:
    from tdpipe.bench.throughput import build_workload

    return build_workload(a, vocab_size, max_model_len, tok)


def to_specs(reqs: list[wl.BenchRequest], chat: bool, tok: _LazyTokenizer) -> list[RequestSpec]:
    """Completions get the token ids themselves; chat gets text (the recorded prompt where the workload
    has it, else the ids decoded), which the server passes through its chat template."""
    if not chat:
        return [RequestSpec(list(r.prompt_token_ids), r.output_len) for r in reqs]
    return [RequestSpec(r.text if r.text else tok.decode(r.prompt_token_ids), r.output_len) for r in reqs]


async def _served_model(client: Any, wanted: str | None, base_url: str) -> tuple[str, int | None]:
    """The model name to request and the server's max_model_len (vLLM's /v1/models carries it)."""
    try:
        models = [m async for m in client.models.list()]
    except Exception as e:  # noqa: BLE001 - no server, wrong key, not OpenAI-compatible
        raise ValueError(f"--base-url {base_url}: GET /models failed: {type(e).__name__}: "
                         + " ".join(str(e).split())[:300]) from None
    if not models:
        raise ValueError(f"--base-url {base_url}: the server lists no model")
    pick = next((m for m in models if m.id == wanted), None) if wanted else models[0]
    if pick is None:
        raise ValueError(f"--served-model-name {wanted}: the server serves {', '.join(m.id for m in models)}")
    mml = getattr(pick, "max_model_len", None) or (pick.model_extra or {}).get("max_model_len")
    return pick.id, int(mml) if isinstance(mml, (int, float)) and mml > 0 else None


def _write_json(path: str, runs: list[dict[str, Any]]) -> None:
    """Atomically (a crash mid-write never leaves half a file where the earlier runs were)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "runs": runs}, f, indent=2)
    os.replace(tmp, path)


def _merge(runs: list[dict[str, Any]], run_rec: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in runs if r.get("label") != run_rec["label"]] + [run_rec]


def run(a: argparse.Namespace) -> int:
    previous = preflight(a)
    label = default_label(a)
    if any(r.get("label") == label for r in previous):
        print(f"note: --json {a.json} has a run labelled {label!r}; this run replaces it", file=sys.stderr)
    if importlib.util.find_spec("openai") is None:  # found before a server starts, not after
        raise ValueError("tdpipe bench serve needs the openai package: pip install openai")
    serve_args = _serve_args(a)
    model_path, vocab, max_pos = _model_info(a.model or _flag_value(serve_args, "--model"))
    tok = _LazyTokenizer(model_path)
    mml_flag = _flag_value(serve_args, "--max-model-len")
    guess_mml = int(mml_flag) if mml_flag and mml_flag.isdigit() else max_pos
    build_requests(a, vocab, guess_mml, tok)  # a bad workload fails now, not after the server has started
    api_key = a.api_key or os.environ.get("TDPIPE_API_KEY")

    server = None
    old_term = None
    try:
        if a.launch:
            cmd = shlex.split(a.launch_command) if a.launch_command else [sys.executable, "-m",
                                                                          "tdpipe.cli", "serve"]
            old_term = signal.signal(signal.SIGTERM, _terminated)  # so `finally` stops the server
            server = LaunchedServer(LaunchConfig(cmd, serve_args, a.startup_timeout, a.shutdown_timeout,
                                                 a.server_log), a.base_url, api_key)
            ready_s = server.wait_ready()
            print(f"server ready after {ready_s:.1f} s", file=sys.stderr, flush=True)
        run_rec = aio.run(_bench(a, label, previous, vocab, guess_mml, model_path, tok, api_key))
    finally:
        if server is not None:
            server.stop()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    status = 0
    if server is not None:
        run_rec["server"]["launch"] = server.record()
        if server.problem:
            print(f"tdpipe: error: the launched server {server.problem}; its log: {server.log_path}",
                  file=sys.stderr)
            status = 1
        if a.json:
            _write_json(a.json, _merge(previous, run_rec))
    if a.plot:
        runs = load_runs(a.json) if a.json else [run_rec]
        print(f"wrote {plot_latency(runs, a.plot)}")
    return status


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM to the bench: unwind like Ctrl-C, so the launched server is stopped


async def _bench(a: argparse.Namespace, label: str, previous: list[dict[str, Any]], vocab: int,
                 guess_mml: int, model_path: str, tok: _LazyTokenizer, api_key: str | None) -> dict[str, Any]:
    import openai

    from tdpipe.bench.machine import machine_info

    rates = parse_rates(a.request_rate)
    slo = SLO(a.slo_ttft, a.slo_tpot)
    chat = a.endpoint == "chat"
    client = openai.AsyncOpenAI(base_url=a.base_url, api_key=api_key or "EMPTY", max_retries=0,
                                timeout=a.request_timeout)
    async with client:
        served, server_mml = await _served_model(client, a.served_model_name, a.base_url)
        name, reqs = build_requests(a, vocab, server_mml or guess_mml, tok)
        specs = to_specs(reqs, chat, tok)
        warm = RequestSpec(specs[0].prompt[:WARMUP_PROMPT_TOKENS] if not chat else specs[0].prompt[:64],
                           WARMUP_OUTPUT_TOKENS)
        w = await send_request(client, served, warm, chat)
        if not w.ok:
            raise ValueError(f"the warm-up request to {a.base_url} failed: {w.error}")
        run_rec: dict[str, Any] = {
            "label": label,
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "server": {"base_url": a.base_url, "endpoint": a.endpoint, "served_model": served,
                       "max_model_len": server_mml, "serve_args": _serve_args(a) if a.launch else None},
            "config": {"request_rates": [rate_label(r) for r in rates], "max_concurrency": a.max_concurrency,
                       "num_prompts": len(reqs), "slo_ttft_ms": a.slo_ttft, "slo_tpot_ms": a.slo_tpot,
                       "request_timeout_s": a.request_timeout, "arrivals": "poisson", "stream": not a.no_stream,
                       "arrival_seed": a.workload_seed + ARRIVAL_SEED_OFFSET,
                       "sampling": {"temperature": 0.0, "ignore_eos": True,
                                    "max_tokens": "workload output_len"}},
            "machine": machine_info(),  # the client's; with --launch or a loopback URL, also the server's
            "model": model_path,
            "workload": {"name": name, "seed": a.workload_seed, **wl.summarize(reqs)},
            "results": [],
        }
        for rate in rates:
            cpu0 = cpu_snapshot()
            results, duration = await run_rate(client, served, specs, rate, a.max_concurrency,
                                               a.workload_seed + ARRIVAL_SEED_OFFSET, chat,
                                               progress=not a.no_progress and sys.stderr.isatty(),
                                               stream=not a.no_stream)
            m = {"request_rate": rate_label(rate)} | rate_metrics(results, duration, slo)
            m["cpu"] = cpu_since(cpu0, duration)
            run_rec["results"].append(m)
            if m["failed"]:
                print(f"rate {rate_label(rate)}: {m['failed']} of {m['num_requests']} requests failed; "
                      f"first: {m['first_error']}", file=sys.stderr)
            if m["output_len_mismatch"]:
                print(f"rate {rate_label(rate)}: {m['output_len_mismatch']} requests returned a different "
                      "number of tokens than max_tokens (does the server honour ignore_eos?)",
                      file=sys.stderr)
            if a.json:  # after every rate: an interrupted sweep keeps the rates it finished
                _write_json(a.json, _merge(previous, run_rec))
    print(format_table(run_rec))
    return run_rec


# -- report --------------------------------------------------------------------------------------------
def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def format_table(run_rec: dict[str, Any]) -> str:
    """A header naming the run, workload and server, then one row per request rate."""
    w, s, c = run_rec["workload"], run_rec["server"], run_rec["config"]
    slo = " and ".join(x for x in (c["slo_ttft_ms"] and f"TTFT <= {c['slo_ttft_ms']:g} ms",
                                    c["slo_tpot_ms"] and f"TPOT <= {c['slo_tpot_ms']:g} ms") if x)
    head = [f"run {run_rec['label']!r}: {s['served_model']} at {s['base_url']} ({s['endpoint']}), "
            f"max concurrency {c['max_concurrency'] or 'unlimited'}",
            f"workload {w['name']} (seed {w['seed']}): {c['num_prompts']} requests per rate, input mean "
            f"{w['input_mean']:.1f}, output mean {w['output_mean']:.1f}; Poisson arrivals",
            f"client machine {describe_machine(run_rec['machine'])}" if run_rec.get("machine") else "",
            "latencies in ms (mean / p50 / p99); tok/s = output tokens/s"
            + (f"; goodput: {slo}" if slo else "")]
    cols = ["rate", "ok/fail", "req/s", "tok/s", "total tok/s", "TTFT", "TPOT", "ITL", "E2E"]
    if slo:
        cols += ["goodput req/s", "SLO met"]
    rows = [cols]
    for m in run_rec["results"]:
        def d(k: str, m: dict = m) -> str:
            x = m[k]
            return f"{_f(x['mean'])} / {_f(x['p50'])} / {_f(x['p99'])}"
        row = [m["request_rate"], f"{m['completed']}/{m['failed']}", f"{m['request_throughput']:.2f}",
               f"{m['output_throughput']:.1f}", f"{m['total_token_throughput']:.1f}", d("ttft_ms"),
               d("tpot_ms"), d("itl_ms"), d("e2e_ms")]
        if slo:
            g = m["goodput"]
            row += [f"{g['requests_per_s']:.2f}", f"{100 * g['attainment']:.0f} %"]
        rows.append(row)
    widths = [max(len(r[k]) for r in rows) for k in range(len(cols))]
    lines = ["  ".join(x.rjust(wd) for x, wd in zip(r, widths)) for r in rows]
    errs = [f"rate {m['request_rate']}: first error: {m['first_error']}" for m in run_rec["results"]
            if m["failed"]]
    return "\n".join([h for h in head if h] + lines + errs)


__all__ = ["SLO", "RequestResult", "RequestSpec", "add_parser", "arrival_offsets", "distribution_ms",
           "parse_rates", "rate_metrics", "run", "send_request"]
