"""The `tdpipe serve` command line: ServerConfig and the flags that fill it. Light on purpose (no FastAPI,
no torch): every `tdpipe` command builds this parser; the command itself (tdpipe/cli.py) imports the
server only to serve, so the server may import ServerConfig from here without a circle."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from tdpipe.config import EngineConfig
from tdpipe.engine_args import EngineArgs


TOOL_CALL_PARSERS = ("hermes",)  # --tool-call-parser's choices (entrypoints/openai/tool_calls.py)
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # --reasoning-parser's choices (entrypoints/openai/reasoning.py)
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass
class ServerConfig:
    """What the HTTP layer needs; build_app reads the first four, `serve` the rest."""

    served_model_name: str | None = None  # None: the engine's model_name (the model folder's name)
    api_key: str | None = None  # when set, every /v1 route needs "Authorization: Bearer <api_key>"
    max_waiting_requests: int = 1024  # a request that would queue beyond this gets 503 + Retry-After
    max_request_body_bytes: int = 8 << 20  # larger bodies get 413 (Content-Length and the bytes read)
    max_prompts_per_request: int = 256  # a completions prompt list longer than this gets 400
    max_connections: int = 2048  # beyond this many open connections (or requests) uvicorn answers 503
    host: str = "127.0.0.1"  # loopback only unless asked
    port: int = 8000
    shutdown_grace_s: float = 30.0  # on SIGTERM/Ctrl-C: how long requests in flight may take to finish
    # an idle keep-alive connection is closed after this; longer than the clients' pools keep one (httpx, so
    # the openai client: 5 s; aiohttp: 15 s), or a client reuses a connection at the moment the server
    # closes it and its request fails with a connection error (uvicorn's own default is 5 s, httpx's too)
    timeout_keep_alive_s: float = 30.0
    access_log: bool = True  # uvicorn's one line per request
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (OpenAI's field), the
    # prompt tokens the prefix cache held
    enable_prompt_tokens_details: bool = False
    # vLLM's tool calling flags: tool_choice "auto" needs both (entrypoints/openai/tool_calls.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # hermes
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: <think>...</think> to message.reasoning
    chat_template: str | None = None  # vLLM's --chat-template: this Jinja text instead of the model's own
    uvicorn_log_level: str = "info"
    # vLLM's CORS settings and defaults: any origin, method and header, without credentials
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, got "
                             f"{self.uvicorn_log_level!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser hermes)")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to serve without a key)")
        for name in ("max_waiting_requests", "max_request_body_bytes", "max_prompts_per_request",
                     "max_connections"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if not self.timeout_keep_alive_s > 0:
            raise ValueError(f"timeout_keep_alive_s must be > 0, got {self.timeout_keep_alive_s}")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `serve` parser, server flags then engine flags; the caller sets its handler (`fn`)."""
    d = ServerConfig()
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
        description="Serve the model over HTTP with OpenAI's API: POST /v1/completions, /v1/chat/completions "
                    "(streaming with stream=true), GET /v1/models, /health, /metrics (Prometheus), POST "
                    "/tokenize, /detokenize. Listens on 127.0.0.1 unless --host says otherwise. SIGTERM or "
                    "Ctrl-C stops accepting, lets requests in flight finish for up to --shutdown-grace "
                    "seconds, aborts the rest and exits 0. See docs/serving.md.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host,
                   help=f"address to listen on (default {d.host}: this machine only; 0.0.0.0 exposes the "
                        "server to the network)")
    g.add_argument("--port", type=int, default=d.port,
                   help=f"TCP port (default {d.port}; 0 picks a free one)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1 route (default: $TDPIPE_API_KEY if "
                        "set, else no key; the variable keeps the key out of `ps`)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the model folder's name)")
    g.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="requests allowed to wait for a batch slot; beyond it new requests get 503 with "
                        f"Retry-After (default {d.max_waiting_requests})")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help=f"larger request bodies get 413 (default {d.max_request_body_bytes})")
    g.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                   help="most prompts one /v1/completions request may batch; more is a 400 (default "
                        f"{d.max_prompts_per_request})")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="most open HTTP connections (and requests in flight); beyond it new requests get 503 "
                        f"(default {d.max_connections})")
    g.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace_s, metavar="SECONDS",
                   help="on SIGTERM/Ctrl-C, how long requests in flight may take to finish before they are "
                        f"aborted (default {d.shutdown_grace_s:g})")
    g.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive_s, metavar="SECONDS",
                   help="close an idle keep-alive connection after this long; keep it above the clients' "
                        "pool expiry (httpx and the openai client: 5 s, aiohttp: 15 s), or a request sent "
                        f"as the server closes the connection fails (default {d.timeout_keep_alive_s:g})")
    g.add_argument("--no-access-log", "--disable-uvicorn-access-log", dest="no_access_log", action="store_true",
                   help="no log line per HTTP request (the second name is vLLM's)")
    g.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=d.uvicorn_log_level,
                   help="uvicorn's own log level (vLLM's flag)")
    g.add_argument("--allowed-origins", type=_json_list, default=list(d.allowed_origins), metavar="JSON",
                   help="CORS: origins browsers may call from, a JSON list (vLLM's flag and default: [\"*\"])")
    g.add_argument("--allowed-methods", type=_json_list, default=list(d.allowed_methods), metavar="JSON",
                   help="CORS: allowed methods, a JSON list (default [\"*\"])")
    g.add_argument("--allowed-headers", type=_json_list, default=list(d.allowed_headers), metavar="JSON",
                   help="CORS: allowed headers, a JSON list (default [\"*\"])")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    add_answer_flags(g)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it: the same as --model (give one of the two)")
    EngineArgs.add_cli_args(p)
    return p


def add_answer_flags(g: argparse._ActionsContainer) -> None:
    """The flags that shape answers (serve and run-batch share them): the chat template, tool calls,
    reasoning, the usage's cached tokens."""
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) used instead of the model's own, "
                        "or for a model that has none (vLLM's flag)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in every answer (OpenAI's field, vLLM's "
                        "flag): the prompt tokens the prefix cache held")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model call the request's tools when tool_choice is \"auto\" (the default with "
                        "tools); needs --tool-call-parser (vLLM's flag)")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how tool calls are read from the answer's text: hermes, <tool_call>{\"name\": ..., "
                        "\"arguments\": ...}</tool_call> (Qwen2.5 / Qwen3, Hermes)")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="a thinking model's <think>...</think> goes to the message's `reasoning` field, the rest "
                        "to its content (vLLM's flag; qwen3 also ends the reasoning at a <tool_call>)")


def answer_settings(a: argparse.Namespace) -> dict[str, Any]:
    """ServerConfig's keywords from add_answer_flags' flags."""
    return {"chat_template": read_chat_template(a.chat_template),
            "enable_prompt_tokens_details": a.enable_prompt_tokens_details,
            "enable_auto_tool_choice": a.enable_auto_tool_choice, "tool_call_parser": a.tool_call_parser,
            "reasoning_parser": a.reasoning_parser}


def server_config(a: argparse.Namespace) -> ServerConfig:
    key = a.api_key if a.api_key is not None else os.environ.get("TDPIPE_API_KEY") or None
    return ServerConfig(served_model_name=a.served_model_name, api_key=key,
                        max_waiting_requests=a.max_waiting_requests,
                        max_request_body_bytes=a.max_request_body_bytes,
                        max_prompts_per_request=a.max_prompts_per_request, max_connections=a.max_connections,
                        host=a.host, port=a.port,
                        shutdown_grace_s=a.shutdown_grace, timeout_keep_alive_s=a.timeout_keep_alive,
                        access_log=not a.no_access_log, **answer_settings(a),
                        uvicorn_log_level=a.uvicorn_log_level, allowed_origins=tuple(a.allowed_origins),
                        allowed_methods=tuple(a.allowed_methods), allowed_headers=tuple(a.allowed_headers),
                        allow_credentials=a.allow_credentials)


def _json_list(text: str) -> list[str]:
    """A JSON list of strings (vLLM's form of the CORS flags)."""
    try:
        v = json.loads(text)
    except ValueError:
        v = None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, such as '[\"*\"]', got {text!r}")
    return v


def read_chat_template(value: str | None) -> str | None:
    """--chat-template's text: the file it names, or the value itself when it is a Jinja template (vLLM reads
    it the same way); anything else is one error naming the flag."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags describe (the same EngineArgs that `LLM(...)`'s keywords fill); the
    positional MODEL, where given, is --model."""
    tag = getattr(a, "model_tag", None)
    if tag is not None:
        if a.model is not None and a.model != tag:
            raise ValueError(f"the model is given twice, {tag!r} and --model {a.model!r}: give it once")
        a.model = tag
    from tdpipe.core.async_llm import AsyncLLM  # zmq and the engine client: only when a server starts

    cfg = EngineArgs.from_cli(a).create_engine_config()
    AsyncLLM.check_config(cfg)
    return cfg
