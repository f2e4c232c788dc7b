"""Benchmark workloads: lists of (prompt token ids, forced output length).

Output lengths are forced (greedy, ignore_eos, max_tokens = output_len) so that every engine compared on a
workload does exactly the same amount of work, whatever text the model happens to produce.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Ids below this hold special/control tokens in most vocabularies (BOS/EOS/<|im_start|>, byte fallbacks...);
# random prompts avoid them so no prompt contains an accidental end-of-text or chat marker.
FIRST_ORDINARY_ID = 100

# ShareGPT-like log-normal parameters; see `sharegpt_like` for where they come from.
SHAREGPT_INPUT_MEDIAN = 145
SHAREGPT_OUTPUT_MEDIAN = 119
SHAREGPT_SIGMA = 1.0


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    text: str | None = None  # the prompt as text, where the workload has it (a learned predictor reads it)
    n: int = 1  # samples per prompt (SamplingParams.n): a GRPO rollout asks for a group of answers per prompt
    temperature: float = 0.0  # greedy unless the workload samples
    seed: int | None = None  # per-request sampling seed: a sampled workload draws the same tokens every run

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    lo = FIRST_ORDINARY_ID if vocab_size > 2 * FIRST_ORDINARY_ID else 0
    return rng.integers(lo, vocab_size, size=n).tolist()


def fixed(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """`num_prompts` requests of exactly `input_len` random prompt tokens and `output_len` output tokens."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"fixed workload needs num_prompts, input_len and output_len >= 1, got "
                         f"{num_prompts}, {input_len}, {output_len}")
    rng = np.random.default_rng(seed)
    return [BenchRequest(_random_ids(rng, input_len, vocab_size), output_len) for _ in range(num_prompts)]


def sharegpt_like(num_prompts: int, vocab_size: int, seed: int = 0, max_model_len: int = 2048, *,
                  max_input: int = 1024, max_output: int = 1024,
                  input_median: float = SHAREGPT_INPUT_MEDIAN, output_median: float = SHAREGPT_OUTPUT_MEDIAN,
                  sigma_input: float = SHAREGPT_SIGMA, sigma_output: float = SHAREGPT_SIGMA,
                  ) -> list[BenchRequest]:
    """Random prompts whose input/output lengths follow log-normals shaped like ShareGPT.

    Why these parameters. vLLM's throughput benchmark samples ShareGPT_V3 (first human turn as prompt,
    the reply's length as output), drops pairs with prompt > 1024 or prompt + output > 2048 tokens or
    either side < 4. A 1000-prompt run of it posted in vllm-project/vllm PR #14036 reports 39.72 req/s,
    16360.76 total tok/s and 7468.34 output tok/s, i.e. a mean of ~224 input and ~188 output tokens per
    request. (For scale: the vLLM paper's Fig. 11 gives 161 in / 338 out over the whole, unfiltered
    ShareGPT; TD-Pipe also follows vLLM's filter of inputs < 1024 tokens.) No median figure was found, so
    the spread is an assumption: sigma = 1.0 for both sides (heavy right tail, mean/median ~1.6 before
    clipping). With sigma fixed, the medians were solved numerically (400k samples, clipping as below with
    max_input = max_output = 1024, max_model_len = 2048) so that the *clipped* means hit the targets:
    input median 145 -> mean ~224, output median 119 -> mean ~188.

    Lengths are rounded, clipped to [4, max_input] and [4, max_output], and the output is then cut so that
    input + output <= max_model_len (the input first to max_model_len - 4). A smaller max_model_len than
    2048 shifts the means down; the caller's engine limit wins over fidelity.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if max_model_len < 8:
        raise ValueError(f"max_model_len must be >= 8 for a sharegpt-like workload, got {max_model_len}")
    rng = np.random.default_rng(seed)
    ins = np.rint(rng.lognormal(math.log(input_median), sigma_input, num_prompts)).astype(np.int64)
    outs = np.rint(rng.lognormal(math.log(output_median), sigma_output, num_prompts)).astype(np.int64)
    ins = np.clip(ins, 4, max(4, min(max_input, max_model_len - 4)))
    outs = np.clip(outs, 4, max(4, max_output))
    outs = np.minimum(outs, max_model_len - ins)
    return [BenchRequest(_random_ids(rng, int(i), vocab_size), int(o)) for i, o in zip(ins, outs)]


# GRPO-like rollout (issue 15 (a)): prompt lengths spread +-12.5 % around the mean (448-576 for 512), so the
# prompts are not all one shape, yet every row of a comparison gets the same ones.
GRPO_INPUT_SPREAD = 0.125
GRPO_SEED_MAX = 2**31  # request seeds stay small: the split rows derive seed * n + i from them


def grpo(num_prompts: int, vocab_size: int, seed: int = 0, *, input_len: int = 512, n: int = 8,
         output_len: int = 256, temperature: float = 1.0) -> list[BenchRequest]:
    """A GRPO-style rollout: `num_prompts` distinct random prompts (lengths uniform in input_len +- 12.5 %),
    each asking for `n` sampled answers of exactly `output_len` tokens at `temperature`, with its own seed.

    Why: RL post-training samples a group of answers per prompt, so the prompt's KV can be computed once
    and shared (fork + copy-on-write) instead of once per answer; the answers differ (temperature 1), so
    the decode work is never shared."""
    if num_prompts < 1 or input_len < 1 or n < 1 or output_len < 1:
        raise ValueError(f"grpo workload needs num_prompts, input_len, n and output_len >= 1, got "
                         f"{num_prompts}, {input_len}, {n}, {output_len}")
    rng = np.random.default_rng(seed)
    spread = int(input_len * GRPO_INPUT_SPREAD)
    lens = rng.integers(max(1, input_len - spread), input_len + spread + 1, size=num_prompts)
    seeds = rng.integers(0, GRPO_SEED_MAX, size=num_prompts)
    return [BenchRequest(_random_ids(rng, int(k), vocab_size), output_len, n=n, temperature=temperature,
                         seed=int(s)) for k, s in zip(lens, seeds)]


def shared_prefix(num_requests: int, vocab_size: int, seed: int = 0, *, prefix_len: int = 1024,
                  question_len: tuple[int, int] = (16, 48), output_len: int = 32) -> list[BenchRequest]:
    """`num_requests` prompts that all start with the same `prefix_len`-token system prompt, followed by a
    distinct random question of question_len[0]..question_len[1] tokens; greedy, `output_len` tokens each.

    Why: a chat service sends one long system prompt with every short question; with prefix caching only
    the first request computes the prefix's KV. Questions are distinct (redrawn on a repeat) so that only
    the system prompt can be shared."""
    lo, hi = question_len
    if num_requests < 1 or prefix_len < 1 or output_len < 1 or lo < 1 or hi < lo:
        raise ValueError(f"shared-prefix workload needs num_requests, prefix_len, output_len >= 1 and "
                         f"1 <= question_len[0] <= question_len[1], got {num_requests}, {prefix_len}, "
                         f"{output_len}, {question_len}")
    ids = vocab_size - (FIRST_ORDINARY_ID if vocab_size > 2 * FIRST_ORDINARY_ID else 0)
    distinct = sum(ids ** k for k in range(lo, hi + 1))
    if distinct < num_requests:
        raise ValueError(f"only {distinct} distinct questions of {lo}-{hi} tokens exist in a vocabulary of "
                         f"{vocab_size}; {num_requests} asked")
    rng = np.random.default_rng(seed)
    prefix = _random_ids(rng, prefix_len, vocab_size)
    seen: set[tuple[int, ...]] = set()
    out = []
    while len(out) < num_requests:
        q = _random_ids(rng, int(rng.integers(lo, hi + 1)), vocab_size)
        if tuple(q) in seen:  # only possible with a tiny vocabulary or very short questions
            continue
        seen.add(tuple(q))
        out.append(BenchRequest(prefix + q, output_len))
    return out


def split_samples(reqs: list[BenchRequest]) -> list[BenchRequest]:
    """Each request with n samples as n independent n=1 requests (seeds seed * n + i): how an engine without
    fork serves parallel sampling (vLLM v1 fans n out into independent child requests), so each copy
    computes the prompt again unless a prefix cache shares it."""
    out = []
    for r in reqs:
        for i in range(r.n):
            out.append(BenchRequest(r.prompt_token_ids, r.output_len, r.text, n=1, temperature=r.temperature,
                                    seed=None if r.seed is None else r.seed * r.n + i))
    return out


def from_jsonl(path: str | Path, tokenizer: Any, limit: int | None = None) -> list[BenchRequest]:
    """Requests from a JSONL file: `prompt` (text, tokenized with special tokens) or `prompt_token_ids`,
    plus `output_len` (or `max_tokens`). Errors name the line, so a broken dataset is fixed in one go."""
    out: list[BenchRequest] = []
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        with f:
            for n, line in enumerate(f, start=1):
                if limit is not None and len(out) >= limit:
                    break
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON: {e}") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
                if "prompt_token_ids" in rec:
                    ids = rec["prompt_token_ids"]
                    if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
                        raise ValueError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers")
                elif "prompt" in rec:
                    if not isinstance(rec["prompt"], str):
                        raise ValueError(f"{where}: 'prompt' must be a string")
                    ids = tokenizer.encode(rec["prompt"], add_special_tokens=True)
                    if not ids:
                        raise ValueError(f"{where}: 'prompt' tokenizes to no tokens")
                else:
                    raise ValueError(f"{where}: missing field 'prompt' or 'prompt_token_ids'")
                key = "output_len" if "output_len" in rec else "max_tokens" if "max_tokens" in rec else None
                if key is None:
                    raise ValueError(f"{where}: missing field 'output_len' (or 'max_tokens')")
                olen = rec[key]
                if not (isinstance(olen, int) and not isinstance(olen, bool) and olen >= 1):
                    raise ValueError(f"{where}: '{key}' must be an integer >= 1, got {olen!r}")
                out.append(BenchRequest(list(ids), olen, rec.get("prompt")))
    except UnicodeDecodeError as e:  # a binary file given by mistake
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); expected JSONL") from None
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def from_history(path: str | Path, tokenizer: Any, split: str = "test", limit: int | None = None,
                 seed: int = 0) -> list[BenchRequest]:
    """Replay a recorded history (tdpipe/predictor/history.py): each prompt through the chat template (as
    `tdpipe generate --chat-template` sent it), its recorded output length forced. `split`: 'all', or
    'train' / 'val' / 'test' of the predictor's 60/20/20 split with `seed`, so a learned predictor is
    benchmarked on prompts it never trained on."""
    from tdpipe.predictor.history import load_history
    from tdpipe.predictor.train import split as split_records
    from tdpipe.tokenizer import chat_prompt

    recs = load_history(str(path))
    parts = {"all": recs}
    if split != "all":
        parts.update(zip(("train", "val", "test"), split_records(recs, seed)))
    if split not in parts:
        raise ValueError(f"history split must be one of all, train, val, test; got {split!r}")
    out = []
    for r in parts[split][:limit]:
        ids = chat_prompt(tokenizer, [{"role": "user", "content": r.prompt}])[1]
        out.append(BenchRequest(ids, max(1, r.output_tokens), r.prompt))
    return out


def model_vocab(path: str | Path) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) of a local model folder, from its config.json alone: what a
    process that builds prompts without loading an engine (bench serve's client, bench throughput's
    transformers side) needs to draw the same token ids."""
    try:
        with open(Path(path) / "config.json", encoding="utf-8") as f:
            cfg = json.load(f)
        cfg = cfg.get("text_config", cfg)
        return int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 2048))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--model {path}: cannot read vocab_size from config.json ({e})") from None


def summarize(reqs: list[BenchRequest]) -> dict[str, float]:
    """Mean/median lengths, printed with every run so the workload behind a number is visible."""
    ins = np.array([r.input_len for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    return {"input_mean": float(ins.mean()), "input_median": float(np.median(ins)), "input_max": int(ins.max()),
            "output_mean": float(outs.mean()), "output_median": float(np.median(outs)),
            "output_max": int(outs.max())}


def add_workload_args(g: Any, seed_help: str = "seed of the synthetic workload", short_seed: bool = False) -> None:
    """The workload flags, shared by `bench throughput` and `bench serve` so both can run the same prompts
    (`short_seed`: also --seed, where no engine flag takes it)."""
    g.add_argument("--workload", choices=["sharegpt", "fixed"], default="sharegpt",
                   help="sharegpt: log-normal lengths shaped like vLLM's ShareGPT sampling (mean ~224 in / "
                        "~188 out); fixed: --input-len/--output-len for every request")
    g.add_argument("--input-len", type=int, default=None, help="prompt tokens per request (implies fixed)")
    g.add_argument("--output-len", type=int, default=None, help="output tokens per request (implies fixed)")
    g.add_argument("--num-prompts", type=int, default=100, help="number of requests (dataset: at most this)")
    g.add_argument("--dataset", default=None,
                   help="JSONL workload: {'prompt' or 'prompt_token_ids', 'output_len' or 'max_tokens'} per line")
    g.add_argument("--history", default=None, metavar="FILE",
                   help="replay a recorded history (--record-history): prompts through the chat template, "
                        "the recorded output lengths forced; see --history-split")
    g.add_argument("--history-split", default="test", choices=["all", "train", "val", "test"],
                   help="which part of the predictor's 60/20/20 split (seed 0) --history replays (default "
                        "test: prompts a learned predictor never trained on)")
    g.add_argument("--workload-seed", *(["--seed"] if short_seed else []), dest="workload_seed", type=int,
                   default=0, metavar="N", help=seed_help)
