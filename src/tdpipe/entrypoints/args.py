"""Command-line flags shared by the subcommands: the engine's come from EngineArgs (tdpipe/engine_args.py,
where each is declared once, with its default and help); the sampling flags are here.

`add_engine_args` / `engine_kwargs` are EngineArgs' own, under the names the benches call."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from tdpipe.engine_args import EngineArgs
from tdpipe.options import default_of


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every engine flag (EngineArgs.add_cli_args)."""
    EngineArgs.add_cli_args(p)


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """`LLM(...)`'s keywords from the parsed engine flags (EngineArgs.from_cli(a).to_kwargs())."""
    return EngineArgs.from_cli(a).to_kwargs()


def field_default(cls: type, name: str) -> Any:
    """The default a dataclass declares for `name` (its factory's value for a mutable one)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return default_of(f)
    raise ValueError(f"{cls.__name__} has no field {name!r}")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128, samples: bool = True) -> None:
    """`samples`: also n, best_of and logprobs (tdpipe generate; the interactive chat shows one answer)."""
    g = p.add_argument_group("sampling")
    from tdpipe.sampling.params import SamplingParams

    def d(name: str) -> Any:
        return field_default(SamplingParams, name)

    # max_tokens and temperature are the command line's own: answers longer than the API's 16 tokens, and
    # greedy unless asked (SamplingParams keeps OpenAI's defaults for the library and the server)
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="most output tokens per request (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=d("top_p"), help="(default: %(default)s)")
    g.add_argument("--top-k", type=int, default=d("top_k"), help="-1 disables (default: %(default)s)")
    g.add_argument("--min-p", type=float, default=d("min_p"), help="(default: %(default)s)")
    g.add_argument("--repetition-penalty", type=float, default=d("repetition_penalty"), help="(default: %(default)s)")
    g.add_argument("--presence-penalty", type=float, default=d("presence_penalty"), help="(default: %(default)s)")
    g.add_argument("--frequency-penalty", type=float, default=d("frequency_penalty"), help="(default: %(default)s)")
    g.add_argument("--sampling-seed", type=int, default=d("seed"), help="per-request seed (reproducible sampling)")
    g.add_argument("--stop", action="append", default=d("stop"), help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS up to --max-tokens")
    if not samples:
        return
    g.add_argument("--n", type=int, default=d("n"),
                   help="answers per prompt; the prompt is prefilled once and its KV blocks shared (default: "
                        "%(default)s)")
    g.add_argument("--best-of", type=int, default=d("best_of"),
                   help="sample this many (>= --n) and keep the --n with the highest cumulative logprob")
    g.add_argument("--logprobs", type=int, default=d("logprobs"), metavar="K",
                   help="per output token: its logprob and rank and the top K (0-20), after penalties and "
                        "temperature")
    g.add_argument("--prompt-logprobs", type=int, default=d("prompt_logprobs"), metavar="K",
                   help="per prompt token: its logprob and rank and the top K (0-20); such prompts are "
                        "prefilled whole (no prefix-cache hit)")


def sampling_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                frequency_penalty=a.frequency_penalty, seed=a.sampling_seed, stop=a.stop, ignore_eos=a.ignore_eos,
                **{k: getattr(a, k) for k in ("n", "best_of", "logprobs", "prompt_logprobs") if hasattr(a, k)})
