"""vLLM engine arguments that mean nothing in tdpipe, accepted so code and command lines written for vLLM run
unchanged (`LLM(model, trust_remote_code=True)`, `tdpipe serve MODEL --trust-remote-code`).

Each is dropped with one warning line saying why it changes nothing here, never silently. Arguments whose
value would change results (a separate `tokenizer`, `quantization`...) are not in this table: tdpipe either
implements them (EngineArgs) or refuses them by name.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tdpipe")


@dataclass(frozen=True)
class IgnoredArg:
    why: str  # what tdpipe does instead
    metavar: str | None = None  # None: a boolean flag (--x / --no-x); else the flag takes a value


IGNORED: dict[str, IgnoredArg] = {
    "trust_remote_code": IgnoredArg("tdpipe's architectures are built in: it never runs code from a model folder"),
    "download_dir": IgnoredArg("tdpipe never downloads weights: --model is a local folder or file", "DIR"),
    "swap_space": IgnoredArg("preempted requests are recomputed, never swapped to CPU memory", "GIB"),
    "disable_log_stats": IgnoredArg("tdpipe logs no periodic statistics (the server's /metrics has them)"),
    "disable_log_requests": IgnoredArg("tdpipe never logs prompts or answers (--no-access-log drops the "
                                       "server's one line per HTTP request)"),
    "enable_chunked_prefill": IgnoredArg("the batching policy decides: hybrid and throttle chunk prompts, "
                                         "separate and td-pipe do not (--scheduler)"),
    "disable_custom_all_reduce": IgnoredArg("tensor parallelism uses torch.distributed's all-reduce"),
    "max_seq_len_to_capture": IgnoredArg("CUDA graphs are captured per decode batch size (--cuda-graph-sizes)",
                                         "N"),
    "distributed_executor_backend": IgnoredArg("tdpipe starts its own stage processes (torchrun or Ray across "
                                               "nodes: docs/parallelism.md)", "NAME"),
    "tokenizer_mode": IgnoredArg("tdpipe uses the model folder's Hugging Face (fast) tokenizer", "MODE"),
    "load_format": IgnoredArg("weights are read from the folder's safetensors, or the GGUF file", "FORMAT"),
    "revision": IgnoredArg("--model is a local folder or file: there is no revision to pick", "REV"),
    "tokenizer_revision": IgnoredArg("the tokenizer is a local folder: there is no revision to pick", "REV"),
    "max_log_len": IgnoredArg("tdpipe never logs prompts", "N"),
    "disable_fastapi_docs": IgnoredArg("the server has no documentation routes (/docs, /openapi.json)"),
}


def _warn(name: str, value: Any) -> None:
    log.warning("%s=%r ignored: %s", name, value, IGNORED[name].why)


def drop_ignored(kw: dict[str, Any]) -> dict[str, Any]:
    """`kw` without the IGNORED keywords, each one present warned about."""
    for name in sorted(IGNORED.keys() & kw.keys()):
        _warn(name, kw[name])
    return {k: v for k, v in kw.items() if k not in IGNORED}


def add_ignored_flags(p: argparse.ArgumentParser) -> None:
    """The IGNORED arguments as flags, in a group of their own; parsed to None unless given."""
    g = p.add_argument_group("accepted for vLLM compatibility, ignored (each says why when given)")
    for name, arg in IGNORED.items():
        flag = "--" + name.replace("_", "-")
        if arg.metavar is None:
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=arg.why)
        else:
            g.add_argument(flag, dest=name, metavar=arg.metavar, default=None, help=arg.why)


def warn_ignored_flags(a: argparse.Namespace) -> None:
    """One warning for each IGNORED flag the command line gave."""
    for name in IGNORED:
        value = getattr(a, name, None)
        if value is not None:
            _warn(name, value)


__all__ = ["IGNORED", "IgnoredArg", "add_ignored_flags", "drop_ignored", "warn_ignored_flags"]
