"""`tdpipe bench serve`: metric arithmetic on synthetic timings, the arrival process, the JSON and plot, and
the whole client path (the real openai async client, streaming) against a stub OpenAI-compatible server
that streams fixed tokens with usage, so no model is loaded."""

import asyncio
import json
import math
import os
import socket
import sys
import threading
import time

import pytest

from tdpipe.bench import serve as bs
from tdpipe.viz import latency as vl

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KEY = "sk-test-key"


# --------------------------------------------------------------------------------------------- stub server
def make_stub_app(state: dict):
    """An OpenAI-compatible server that streams `max_tokens` tokens, TWO per chunk (so counting chunks would
    give the wrong number: the bench must read usage), after FIRST_DELAY s and CHUNK_DELAY s apart.
    `state` records every body and the peak number of requests in flight; state['fail'] > 0 makes that many
    measured (non-warm-up) requests fail with a 500; state['usage'] False drops the usage chunk."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    state.setdefault("bodies", [])
    state.setdefault("auth", [])
    state.setdefault("inflight", 0)
    state.setdefault("peak", 0)
    state.setdefault("fail", 0)
    state.setdefault("usage", True)
    lock = threading.Lock()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    def error(msg: str, status: int) -> JSONResponse:
        return JSONResponse({"error": {"message": msg, "type": "x", "param": None, "code": None}}, status)

    def bad_key(request: Request) -> bool:
        return bool(state.get("key")) and request.headers.get("authorization") != f"Bearer {state['key']}"

    @app.get("/v1/models")
    async def models(request: Request):
        if bad_key(request):
            return error("bad key", 401)
        card = {"id": "stub-model", "object": "model", "created": 0, "owned_by": "t", "max_model_len": 512}
        return {"object": "list", "data": [card]}

    async def stream(request: Request, chat: bool):
        body = await request.json()
        state["bodies"].append(body)
        state["auth"].append(request.headers.get("authorization"))
        if bad_key(request):
            return error("bad key", 401)
        n = body["max_tokens"]
        if n != bs.WARMUP_OUTPUT_TOKENS:
            with lock:
                fail = state["fail"] > 0
                state["fail"] -= fail
            if fail:
                return error("stub overloaded", 500)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        if not body.get("stream"):  # --no-stream: the whole answer, after the first delay
            await asyncio.sleep(state["first_delay"])
            text = " t" * n
            choice0 = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                       if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            return {"id": "x", "object": "chat.completion" if chat else "text_completion", "created": 0,
                    "model": "stub-model", "choices": [choice0],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}}

        def chunk(choices, usage=None):
            obj = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
                   "model": "stub-model", "choices": choices}
            if usage is not None:
                obj["usage"] = usage
            return f"data: {json.dumps(obj)}\n\n"

        def choice(text, finish=None, role=None):
            if chat:
                delta = {"content": text} | ({"role": role} if role else {})
                return [{"index": 0, "delta": delta, "finish_reason": finish}]
            return [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]

        async def gen():
            with lock:
                state["inflight"] += 1
                state["peak"] = max(state["peak"], state["inflight"])
            try:
                if chat:
                    yield chunk(choice("", role="assistant"))  # the role announcement is not a token
                await asyncio.sleep(state["first_delay"])
                for i in range(0, n, 2):
                    if i:
                        await asyncio.sleep(state["chunk_delay"])
                    yield chunk(choice(f" t{i} t{i + 1}", "length" if i + 2 >= n else None))
                if state["usage"]:
                    yield chunk([], {"prompt_tokens": n_prompt, "completion_tokens": n,
                                     "total_tokens": n_prompt + n})
                yield "data: [DONE]\n\n"
            finally:
                with lock:
                    state["inflight"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await stream(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await stream(request, chat=True)

    return app


class StubServer:
    """The stub on 127.0.0.1 in a thread (uvicorn on a socket bound here, so the port is known and free)."""

    def __init__(self, **state) -> None:
        import uvicorn

        self.state = {"first_delay": 0.02, "chunk_delay": 0.01} | state
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then; with Nagle on, a
        # reused connection holds the streamed chunks back (~40 ms delayed ACK) and the timings lie
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        app = make_stub_app(self.state)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "StubServer":
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                return self
            time.sleep(0.01)
        raise RuntimeError("stub server did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def model_dir(tmp_path):
    """What the bench reads of a model: config.json (vocabulary size, max positions) and, for the chat
    endpoint's text prompts, a tokenizer (a 1000-word word-level one: no model download, no weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 1000, "max_position_embeddings": 512}))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return str(d)


def bench(argv: list[str]) -> int:
    from tdpipe.cli import main

    return main(["bench", "serve", "--no-progress", *argv])


# ------------------------------------------------------------------------------------------------ metrics
def test_distribution_ms_percentiles():
    d = bs.distribution_ms([1.0, 2.0, 3.0, 4.0])
    assert d["mean"] == pytest.approx(2500.0)
    assert d["p50"] == pytest.approx(2500.0)
    assert d["p90"] == pytest.approx(3700.0)  # linear interpolation: 3 + 0.7 * (4 - 3) s
    assert d["p99"] == pytest.approx(3970.0)
    assert bs.distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_excludes_first_token_and_counts_usage_tokens():
    r = bs.RequestResult(ok=True, output_len=11, output_tokens=11, ttft=0.1, e2e=1.1)
    assert r.tpot == pytest.approx(0.1)  # (1.1 - 0.1) / (11 - 1)
    assert bs.RequestResult(ok=True, output_len=1, output_tokens=1, ttft=0.1, e2e=0.1).tpot is None
    assert bs.RequestResult(ok=False, output_len=5, error="x").tpot is None


def _results() -> list[bs.RequestResult]:
    """A: fast; B: TTFT 500 ms; C: TPOT 80 ms; D: failed; E: one token, TTFT 100 ms (no TPOT)."""
    return [
        bs.RequestResult(ok=True, output_len=11, prompt_tokens=10, output_tokens=11, ttft=0.1, e2e=0.3,
                         itl=[0.02] * 10),
        bs.RequestResult(ok=True, output_len=11, prompt_tokens=10, output_tokens=11, ttft=0.5, e2e=0.7,
                         itl=[0.02] * 10),
        bs.RequestResult(ok=True, output_len=11, prompt_tokens=10, output_tokens=11, ttft=0.1, e2e=0.9,
                         itl=[0.08] * 10),
        bs.RequestResult(ok=False, output_len=11, error="APIStatusError: boom"),
        bs.RequestResult(ok=True, output_len=1, prompt_tokens=10, output_tokens=1, ttft=0.1, e2e=0.1),
    ]


def test_rate_metrics_counts_throughput_and_latencies():
    m = bs.rate_metrics(_results(), 2.0, bs.SLO())
    assert (m["num_requests"], m["completed"], m["failed"]) == (5, 4, 1)
    assert m["first_error"] == "APIStatusError: boom"
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_tokens"] == 34 and m["input_tokens"] == 40
    assert m["output_throughput"] == pytest.approx(17.0)
    assert m["total_token_throughput"] == pytest.approx(37.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)  # (100 + 500 + 100 + 100) / 4
    assert m["tpot_ms"]["mean"] == pytest.approx(40.0)  # 20, 20, 80 ms; the one-token request has none
    assert m["itl_ms"]["mean"] == pytest.approx(40.0)  # 30 gaps pooled: 10 x 20, 10 x 20, 10 x 80
    assert m["e2e_ms"]["p50"] == pytest.approx(500.0)
    assert m["goodput"] is None and m["output_len_mismatch"] == 0


def test_goodput_needs_every_given_slo():
    both = bs.rate_metrics(_results(), 2.0, bs.SLO(ttft_ms=200, tpot_ms=50))["goodput"]
    assert both["good_requests"] == 2  # A and the one-token E; B misses TTFT, C misses TPOT, D failed
    assert both["requests_per_s"] == pytest.approx(1.0)
    assert both["attainment"] == pytest.approx(0.4)
    ttft_only = bs.rate_metrics(_results(), 2.0, bs.SLO(ttft_ms=200))["goodput"]
    assert ttft_only["good_requests"] == 3  # A, C, E
    tpot_only = bs.rate_metrics(_results(), 4.0, bs.SLO(tpot_ms=50))["goodput"]
    assert tpot_only["good_requests"] == 3 and tpot_only["requests_per_s"] == pytest.approx(0.75)  # A, B, E
    with pytest.raises(ValueError, match="duration_s"):
        bs.rate_metrics(_results(), 0.0, bs.SLO())


def test_output_len_mismatch_counted():
    r = bs.RequestResult(ok=True, output_len=8, prompt_tokens=3, output_tokens=5, ttft=0.1, e2e=0.5)
    assert bs.rate_metrics([r], 1.0, bs.SLO())["output_len_mismatch"] == 1


# ------------------------------------------------------------------------------------------------ arrivals
def test_parse_rates():
    assert bs.parse_rates("0.5,1, 2,inf") == [0.5, 1.0, 2.0, math.inf]
    for bad in ("0", "-1", "x", "nan", "1,,2"):
        with pytest.raises(ValueError, match="--request-rate"):
            bs.parse_rates(bad)


def test_default_label_names_the_mode():
    import argparse

    def label(rest):
        return bs.default_label(argparse.Namespace(label=None, launch=True, serve_args="", serve_args_rest=rest))

    assert label(["--pp", "2", "--scheduler", "td-pipe"]) == "td-pipe pp=2"
    assert label(["--disaggregation", "pd", "--decode-workers", "2"]) == "pd P=1 D=2"


def test_arrival_offsets_poisson():
    assert bs.arrival_offsets(4, math.inf, 0) == [0.0] * 4
    a = bs.arrival_offsets(20000, 4.0, 7)
    assert a == bs.arrival_offsets(20000, 4.0, 7)  # seeded
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.03)  # mean gap 1 / rate
    cv = (sum((g - 0.25) ** 2 for g in gaps) / len(gaps)) ** 0.5 / 0.25
    assert cv == pytest.approx(1.0, rel=0.05)  # exponential gaps: standard deviation = mean
    assert bs.arrival_offsets(5, 1.0, 1) != bs.arrival_offsets(5, 1.0, 2)


def test_server_root_and_flags():
    assert bs.server_root("http://h:1/v1") == "http://h:1"
    assert bs.server_root("http://h:1/v1/") == "http://h:1"
    assert bs.host_port("http://127.0.0.1:8123/v1") == ("127.0.0.1", 8123)
    with pytest.raises(ValueError, match="--base-url"):
        bs.host_port("127.0.0.1:8000")
    assert bs._flag_value(["--pp", "2", "--scheduler=td-pipe"], "--scheduler") == "td-pipe"
    assert bs._flag_value(["--pp", "2"], "--pp") == "2"


# ------------------------------------------------------------------------------------------------ plot
def _doc(*runs) -> dict:
    return {"format": vl.FORMAT, "runs": list(runs)}


def _run(label: str, rates: list[str], ttft: list[float | None]) -> dict:
    return {"label": label, "results": [{"request_rate": r, "ttft_ms": {"mean": t}, "tpot_ms": {"mean": 10.0}}
                                        for r, t in zip(rates, ttft)]}


def test_latency_series_union_of_rates_inf_last():
    runs = vl.validate_runs(_doc(_run("a", ["1", "inf"], [5.0, 50.0]), _run("b", ["2", "1"], [6.0, None])))
    rates, lines = vl.series(runs, "ttft_ms")
    assert rates == [1.0, 2.0, math.inf]
    assert lines == {"a": [5.0, None, 50.0], "b": [None, 6.0, None]}


def test_latency_validation_names_the_problem(tmp_path):
    for doc, msg in [([], "JSON object"), ({"format": "x"}, "unsupported format"),
                     (_doc({"label": 1, "results": []}), r"runs\[0\]"),
                     (_doc({"label": "a", "results": [{"request_rate": "0", "ttft_ms": {}, "tpot_ms": {}}]}),
                      r"results\[0\].request_rate"),
                     (_doc({"label": "a", "results": [{"request_rate": "1", "tpot_ms": {}}]}), "ttft_ms"),
                     (_doc({"label": "a", "results": [{"request_rate": "1", "ttft_ms": {"mean": "x"},
                                                       "tpot_ms": {}}]}), "ttft_ms.mean")]:
        with pytest.raises(ValueError, match=msg):
            vl.validate_runs(doc)
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        vl.load_runs(p)


def test_plot_latency_and_cli(tmp_path):
    from tdpipe.cli import main

    j = tmp_path / "r.json"
    j.write_text(json.dumps(_doc(_run("separate pp=2", ["1", "2", "inf"], [10.0, 20.0, 90.0]),
                                 _run("throttle pp=2", ["1", "2", "inf"], [8.0, None, 70.0]))))
    out = tmp_path / "lat.png"
    assert main(["plot", "latency", "--json", str(j), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 1000
    assert main(["plot", "latency", "--json", str(tmp_path / "missing.json"), "-o", str(out)]) == 2
    with pytest.raises(ValueError, match="no results"):
        vl.plot_latency([{"label": "a", "results": []}], tmp_path / "x.png")


# ------------------------------------------------------------------------------------------------ CLI checks
def test_preflight_fails_before_any_request(tmp_path, model_dir, capsys):
    dead = "http://127.0.0.1:9/v1"  # nothing listens; a preflight error must come first
    cases = [
        (["--json", str(tmp_path / "no" / "r.json")], "directory"),
        (["--plot", str(tmp_path / "no" / "p.png")], "--plot"),
        (["--request-rate", "0"], "--request-rate"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--slo-ttft", "-5"], "--slo-ttft"),
        (["--append"], "--append needs --json"),
        (["--", "--pp", "2"], "only for --launch"),
        (["--launch", "--", "--port", "9000"], "--port after --"),
        (["--num-prompts", "0"], "--num-prompts"),
        (["--dataset", str(tmp_path / "none.jsonl")], "--dataset"),
    ]
    for argv, msg in cases:
        assert bench(["--base-url", dead, "--model", model_dir, *argv]) == 2, argv
        assert msg in capsys.readouterr().err, argv
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}')
    assert bench(["--base-url", dead, "--model", model_dir, "--json", str(bad), "--append"]) == 2
    assert "unsupported format" in capsys.readouterr().err
    assert bad.read_text() == '{"format": "other"}'  # untouched


def test_no_server_and_unknown_model_are_one_line(model_dir, capsys):
    assert bench(["--base-url", "http://127.0.0.1:9/v1", "--model", model_dir, "--input-len", "4",
                  "--output-len", "2"]) == 2
    assert "GET /models failed" in capsys.readouterr().err
    with StubServer() as stub:
        assert bench(["--base-url", stub.url, "--model", model_dir, "--input-len", "4", "--output-len", "2",
                      "--served-model-name", "other"]) == 2
        assert "the server serves stub-model" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ end to end
def test_end_to_end_against_stub(tmp_path, model_dir, capsys):
    out_json, png = tmp_path / "serve.json", tmp_path / "lat.png"
    common = ["--model", model_dir, "--input-len", "8", "--output-len", "4", "--num-prompts", "6",
              "--json", str(out_json), "--plot", str(png), "--slo-ttft", "10000", "--slo-tpot", "10000"]
    with StubServer(key=KEY) as stub:
        rc = bench(["--base-url", stub.url, "--api-key", KEY, "--request-rate", "inf,40", "--label", "a",
                    "--max-concurrency", "2", *common])
        assert rc == 0, capsys.readouterr().err
        table = capsys.readouterr().out
        measured = [b for b in stub.state["bodies"] if b["max_tokens"] == 4]
        assert len(measured) == 12 and len(stub.state["bodies"]) == 13  # 2 rates x 6, and one warm-up
        for b in measured:
            assert len(b["prompt"]) == 8 and all(type(t) is int for t in b["prompt"])  # token ids
            assert b["temperature"] == 0 and b["ignore_eos"] is True and b["stream"] is True
            assert b["stream_options"] == {"include_usage": True} and b["model"] == "stub-model"
        assert set(stub.state["auth"]) == {f"Bearer {KEY}"}
        assert stub.state["peak"] <= 2  # --max-concurrency

        # the same prompts as `tdpipe bench throughput` builds for these flags
        from tdpipe.bench import workload as wl

        want = [r.prompt_token_ids for r in wl.fixed(6, 8, 4, 1000, 0)]
        # two requests in flight (--max-concurrency 2) may reach the stub in either order
        assert sorted(b["prompt"] for b in measured[:6]) == sorted(want)

        rc = bench(["--base-url", stub.url, "--api-key", KEY, "--request-rate", "inf", "--label", "b",
                    "--endpoint", "chat", "--append", *common])
        assert rc == 0
        chat = [b for b in stub.state["bodies"][13:] if b["max_tokens"] == 4]
        assert len(chat) == 6 and all(b["messages"][0]["role"] == "user" for b in chat)
        assert chat[0]["messages"][0]["content"] == " ".join(f"w{i}" for i in want[0])  # the ids as text

    assert "inf" in table and "ok/fail" in table and "6/0" in table
    doc = json.loads(out_json.read_text())
    assert doc["format"] == vl.FORMAT
    assert [r["label"] for r in doc["runs"]] == ["a", "b"]
    a = doc["runs"][0]
    assert [m["request_rate"] for m in a["results"]] == ["inf", "40"]
    assert a["server"]["served_model"] == "stub-model" and a["server"]["max_model_len"] == 512
    assert a["workload"]["name"] == "fixed" and a["config"]["max_concurrency"] == 2
    assert "cpu" in a["machine"]
    for m in a["results"] + doc["runs"][1]["results"]:
        assert (m["completed"], m["failed"], m["output_len_mismatch"]) == (6, 0, 0)
        assert m["output_tokens"] == 24  # from usage: 4 per request, although only 2 chunks each
        # the stub waits 20 ms before the first chunk and 10 ms between chunks: lower bounds for the times from
        # the request's start; a gap between two arrivals is not one (a first chunk delivered late on a loaded
        # machine shortens it: 9.98 ms was seen), so the inter-token latency gets a loose bound
        assert m["ttft_ms"]["p50"] >= 20 and m["e2e_ms"]["mean"] >= 30 and m["itl_ms"]["mean"] >= 5
        assert m["tpot_ms"]["mean"] >= 10 / 3  # one 10 ms gap over 3 tokens after the first
        assert m["goodput"]["good_requests"] == 6 and m["goodput"]["attainment"] == 1.0
    assert a["results"][0]["input_tokens"] == 48
    assert png.read_bytes()[:8] == PNG_MAGIC  # drawn from both runs in the JSON

    # --append with an existing label replaces that run
    with StubServer(key=KEY) as stub:
        assert bench(["--base-url", stub.url, "--api-key", KEY, "--request-rate", "20", "--label", "a",
                      "--append", *common]) == 0
    doc = json.loads(out_json.read_text())
    assert [r["label"] for r in doc["runs"]] == ["b", "a"]
    assert [m["request_rate"] for m in doc["runs"][1]["results"]] == ["20"]


def test_failed_requests_reported(tmp_path, model_dir, capsys):
    with StubServer(fail=2) as stub:
        rc = bench(["--base-url", stub.url, "--model", model_dir, "--input-len", "4", "--output-len", "4",
                    "--num-prompts", "5", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    err = capsys.readouterr().err
    assert "2 of 5 requests failed" in err and "stub overloaded" in err
    m = json.loads((tmp_path / "r.json").read_text())["runs"][0]["results"][0]
    assert (m["completed"], m["failed"]) == (3, 2) and "stub overloaded" in m["first_error"]
    assert m["goodput"] is None


def test_stream_without_usage_is_a_failure(model_dir, capsys):
    with StubServer(usage=False) as stub:
        assert bench(["--base-url", stub.url, "--model", model_dir, "--input-len", "4",
                      "--output-len", "4"]) == 2
    assert "warm-up request" in (e := capsys.readouterr().err) and "no usage" in e


def test_wrong_key_is_reported(model_dir, capsys):
    with StubServer(key=KEY) as stub:
        assert bench(["--base-url", stub.url, "--model", model_dir, "--api-key", "wrong", "--input-len", "4",
                      "--output-len", "2"]) == 2
    assert "401" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ --launch
STUB_MAIN = """
import importlib.util, json, os, signal, sys
import uvicorn
spec = importlib.util.spec_from_file_location("stubmod", {test_file!r})
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
argv = sys.argv[1:]
child = None
if "--orphan" in argv:  # a "stage" that ignores SIGTERM and outlives the server
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]).pid
with open({record!r}, "w") as f:
    json.dump({{"argv": argv, "key": os.environ.get("TDPIPE_API_KEY"), "child": child}}, f)
if "--die" in argv:
    print("stub: refusing to start", flush=True); sys.exit(3)
host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
state = {{"first_delay": 0.0, "chunk_delay": 0.0, "key": os.environ.get("TDPIPE_API_KEY")}}
# uvicorn re-raises SIGTERM after its graceful shutdown (exit -15); a no-op handler there makes it exit 0
if "--exit-by-signal" not in argv:
    signal.signal(signal.SIGTERM, lambda *a: None)
uvicorn.run(mod.make_stub_app(state), host=host, port=port, log_level="warning")
"""


def _launch_stub(tmp_path) -> tuple[str, str]:
    record = str(tmp_path / "argv.json")
    script = tmp_path / "stub_main.py"
    script.write_text(STUB_MAIN.format(test_file=os.path.abspath(__file__), record=record))
    return f"{sys.executable} {script}", record


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_launch_runs_stops_and_checks_the_server(tmp_path, model_dir, capsys):
    cmd, record = _launch_stub(tmp_path)
    url = f"http://127.0.0.1:{_free_port()}/v1"
    out_json = tmp_path / "r.json"
    rc = bench(["--launch", "--launch-command", cmd, "--base-url", url, "--api-key", KEY,
                "--model", model_dir, "--input-len", "4", "--output-len", "2", "--num-prompts", "3",
                "--json", str(out_json),
                "--server-log", str(tmp_path / "server.log"), "--", "--scheduler", "td-pipe", "--pp", "2"])
    assert rc == 0, capsys.readouterr().err
    got = json.loads(open(record).read())
    assert got["argv"][-4:] == ["--scheduler", "td-pipe", "--pp", "2"]
    assert "--host" in got["argv"] and KEY not in got["argv"] and got["key"] == KEY
    run = json.loads(out_json.read_text())["runs"][0]
    assert run["label"] == "td-pipe pp=2"  # from the engine flags
    launch = run["server"]["launch"]
    assert launch["clean_exit"] and launch["exit_code"] == 0  # uvicorn exits 0 on SIGTERM
    assert run["results"][0]["completed"] == 3
    assert not bs._listening("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0]))  # it is gone


@pytest.mark.slow
def test_launch_failure_shows_the_log(tmp_path, model_dir, capsys):
    cmd, _ = _launch_stub(tmp_path)
    rc = bench(["--launch", "--launch-command", cmd, "--base-url", f"http://127.0.0.1:{_free_port()}/v1",
                "--model", model_dir, "--input-len", "4", "--output-len", "2", "--", "--die"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "exited with code 3" in err and "stub: refusing to start" in err


@pytest.mark.slow
def test_launch_reports_an_unclean_stop(tmp_path, model_dir, capsys):
    """A server killed by its own SIGTERM (exit -15) or leaving a process of its group behind fails the
    bench (exit 1) after the results are written; the leftover is killed."""
    cmd, record = _launch_stub(tmp_path)
    for flag, msg in (("--exit-by-signal", "exited with code -15"), ("--orphan", "outlived it")):
        out_json = tmp_path / f"{flag}.json"
        rc = bench(["--launch", "--launch-command", cmd, "--base-url", f"http://127.0.0.1:{_free_port()}/v1",
                    "--model", model_dir, "--input-len", "4", "--output-len", "2", "--num-prompts", "2",
                    "--json", str(out_json), "--", flag])
        assert rc == 1
        assert msg in capsys.readouterr().err
        launch = json.loads(out_json.read_text())["runs"][0]["server"]["launch"]
        assert not launch["clean_exit"] and msg in launch["problem"]
    child = json.loads(open(record).read())["child"]
    for _ in range(100):  # killed by the bench; reaped by init once its parent is gone
        if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"process {child} outlived the bench")


def test_launch_refuses_a_busy_port(tmp_path, model_dir, capsys):
    with StubServer() as stub:
        assert bench(["--launch", "--launch-command", "false", "--base-url", stub.url, "--model", model_dir,
                      "--input-len", "4", "--output-len", "2"]) == 2
    assert "already listens" in capsys.readouterr().err


@pytest.mark.slow
def test_launch_real_tdpipe_serve(tmp_path, capsys):
    """The whole path with the real server: `tdpipe serve` started by --launch on the bundled model, greedy
    ignore_eos requests whose usage counts are exactly the workload's, then a SIGTERM it must obey (exit 0,
    no stage or engine process left)."""
    out_json = tmp_path / "real.json"
    rc = bench(["--launch", "--base-url", f"http://127.0.0.1:{_free_port()}/v1", "--input-len", "8",
                "--output-len", "4", "--num-prompts", "3", "--request-rate", "inf", "--json", str(out_json),
                "--server-log", str(tmp_path / "serve.log"), "--", "--kv-cache-memory", "64MiB"])
    assert rc == 0, capsys.readouterr().err + (tmp_path / "serve.log").read_text()[-3000:]
    run = json.loads(out_json.read_text())["runs"][0]
    assert run["label"] == "separate pp=1"
    assert run["server"]["launch"]["clean_exit"] and run["server"]["launch"]["exit_code"] == 0
    m = run["results"][0]
    assert (m["completed"], m["failed"], m["output_len_mismatch"]) == (3, 0, 0)
    assert m["output_tokens"] == 12 and m["input_tokens"] == 24


def test_no_stream_asks_for_whole_answers(tmp_path, model_dir, capsys):
    with StubServer() as stub:
        for endpoint in ("completions", "chat"):
            rc = bench(["--base-url", stub.url, "--model", model_dir, "--input-len", "4", "--output-len", "6",
                        "--num-prompts", "3", "--no-stream", "--endpoint", endpoint,
                        "--json", str(tmp_path / f"{endpoint}.json")])
            assert rc == 0, capsys.readouterr().err
    measured = [b for b in stub.state["bodies"] if b["max_tokens"] == 6]
    assert len(measured) == 6 and not any(b["stream"] for b in measured)
    for endpoint in ("completions", "chat"):
        run = json.loads((tmp_path / f"{endpoint}.json").read_text())["runs"][0]
        m = run["results"][0]
        assert run["config"]["stream"] is False and (m["completed"], m["output_tokens"]) == (3, 18)
        assert m["ttft_ms"]["mean"] == pytest.approx(m["e2e_ms"]["mean"]) and m["ttft_ms"]["p50"] >= 20
