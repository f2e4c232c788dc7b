"""Token-level perplexity over a text file, per quantization: ``tdpipe bench perplexity``.

The text is tokenised once and cut into windows of `--window` tokens (at most `--max-tokens` in all); each
window is one request with `prompt_logprobs=1`, so the engine itself scores every token after the first of
its window (the same forward passes a user's requests run: paged KV, chunked prefill, the chosen linears).

    perplexity = exp(- mean over scored tokens of log p(token | the window's tokens before it))

With more than one `--quantization`, each runs in turn on the same windows, and each one after the first is
also compared with the first: `top1_agreement` is the share of positions whose most likely next token is the
same (the greedy agreement of teacher-forced decoding), reported, not judged. `--kv-cache-dtype auto,int8` runs
each quantization with each KV cache (an int8 cache is read by the prompt's own attention too, so its loss shows
here as it would in decoding).

A quantised run is one sample of its rounding noise: scales moved by one ulp (a change far below bf16's
precision) move the bundled model's W8A8 perplexity over a range of 0.12% (0.4% before W8A8 rotated its
inputs), so read smaller differences between two int8 variants as no difference
(scripts/quant/ppl_realizations.py measures the spread; docs/quantization.md).

Default text: the recorded prompts in data/history/prompts.jsonl (chatterbot-corpus lines and templated
instructions, see data/history/README.md); a .jsonl file gives its "text" or "prompt" fields (or its
"messages" contents), any other file its raw text.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from tdpipe.bench.machine import write_json
from tdpipe.config import KV_CACHE_DTYPES, QUANTIZATIONS

DEFAULT_DATASET = Path(__file__).resolve().parents[3] / "data" / "history" / "prompts.jsonl"


def read_text(path: Path) -> str:
    """The file's text: a .jsonl's "text" (else "prompt", else the "messages" contents) fields joined by blank
    lines, or the raw text."""
    if path.suffix == ".jsonl":
        parts = []
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            text = row.get("text", row.get("prompt"))
            if text is None and isinstance(row.get("messages"), list):  # a chat: its turns' contents
                text = "\n".join(str(m.get("content", "")) for m in row["messages"] if isinstance(m, dict))
            if not isinstance(text, str):
                raise ValueError(f"{path}:{i + 1}: a line without a string 'text' or 'prompt' field, or "
                                 "'messages' with 'content'")
            parts.append(text)
        return "\n\n".join(parts)
    return path.read_text()


def windows(ids: list[int], window: int, max_tokens: int) -> list[list[int]]:
    """Consecutive windows of `window` tokens over the first `max_tokens` ids (a last short window only if it
    has at least 2 tokens: one to condition on, one to score)."""
    ids = ids[:max_tokens]
    out = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [w for w in out if len(w) >= 2]


def score(llm: Any, wins: list[list[int]]) -> tuple[list[float], list[int]]:
    """(log p of every scored token, the top-1 token at every scored position), windows in order."""
    from tdpipe import SamplingParams

    outs = llm.generate([{"prompt_token_ids": w} for w in wins],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    lps: list[float] = []
    top: list[int] = []
    for w, o in zip(wins, outs):
        if o.error:
            raise RuntimeError(f"a window failed: {o.error}")
        for pos, entry in enumerate(o.prompt_logprobs[1:], start=1):
            lps.append(entry[w[pos]].logprob)
            top.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return lps, top


def run(model: str | None, quantizations: list[str], dataset: Path, window: int, max_tokens: int,
        engine_kwargs: dict[str, Any], kv_cache_dtypes: tuple[str, ...] = ("auto",)) -> dict[str, Any]:
    """Every quantization with every KV cache dtype (quantization outer), the first pair the reference."""
    from tdpipe import LLM

    text = read_text(dataset)
    rows: list[dict[str, Any]] = []
    first_top: list[int] | None = None
    wins: list[list[int]] = []
    for q, kv in ((q, kv) for q in quantizations for kv in kv_cache_dtypes):
        t0 = time.perf_counter()
        with LLM(model, quantization=q, kv_cache_dtype=kv, **engine_kwargs) as llm:
            if not wins:
                wins = windows(llm.get_tokenizer().encode(text), window, max_tokens)
                if not wins:
                    raise ValueError(f"{dataset}: fewer than 2 tokens of text")
            lps, top = score(llm, wins)
        nll = -sum(lps) / len(lps)
        row = {"quantization": q, "kv_cache_dtype": kv, "perplexity": math.exp(nll), "nll": nll,
               "scored_tokens": len(lps), "seconds": time.perf_counter() - t0}
        if first_top is None:
            first_top = top
        else:
            row["top1_agreement"] = sum(a == b for a, b in zip(top, first_top)) / len(top)
        rows.append(row)
    base = rows[0]["perplexity"]
    for r in rows:
        r["vs_first"] = r["perplexity"] / base
    return {"model": model or "bundled SmolLM2-135M-Instruct", "dataset": str(dataset), "window": window,
            "windows": len(wins), "rows": rows}


def _label(row: dict[str, Any]) -> str:
    kv = row.get("kv_cache_dtype", "auto")
    return row["quantization"] + ("" if kv == "auto" else f", {kv} KV")


def table(r: dict[str, Any]) -> str:
    lines = ["| quantization | perplexity | vs " + _label(r["rows"][0]) + " | top-1 agreement | tokens |",
             "| --- | --- | --- | --- | --- |"]
    for x in r["rows"]:
        agree = f"{x['top1_agreement']:.1%}" if "top1_agreement" in x else "-"
        lines.append(f"| {_label(x)} | {x['perplexity']:.4f} | {x['vs_first'] - 1:+.2%} | {agree} | "
                     f"{x['scored_tokens']} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder, GGUF file or name (default: the bundled model)")
    p.add_argument("--quantization", default="none,w8a8",
                   help=f"comma-separated, each of {list(QUANTIZATIONS)}; the first is the reference of the "
                        "others (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help=f"comma-separated, each of {list(KV_CACHE_DTYPES)}; every --quantization runs with each, "
                        "the first pair the reference (default: %(default)s)")
    p.add_argument("--dataset", type=Path, default=DEFAULT_DATASET,
                   help="text file (.jsonl: its 'text' or 'prompt' fields) (default: data/history/prompts.jsonl)")
    p.add_argument("--window", type=int, default=512, help="tokens per scored window (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32768,
                   help="tokens of the text scored at most (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="the engine's --dtype (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="the engine's KV cache (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


def cmd(a: argparse.Namespace) -> int:
    from tdpipe.engine_args import parse_memory

    qs = [q for q in a.quantization.split(",") if q]
    bad = [q for q in qs if q not in QUANTIZATIONS]
    if not qs or bad:
        raise SystemExit(f"tdpipe bench perplexity: --quantization: {bad or 'none given'}; each must be one of "
                         f"{list(QUANTIZATIONS)}")
    kvs = [k for k in a.kv_cache_dtype.split(",") if k]
    bad = [k for k in kvs if k not in KV_CACHE_DTYPES]
    if not kvs or bad:
        raise SystemExit(f"tdpipe bench perplexity: --kv-cache-dtype: {bad or 'none given'}; each must be one of "
                         f"{list(KV_CACHE_DTYPES)}")
    if a.window < 2:
        raise SystemExit("tdpipe bench perplexity: --window must be at least 2")
    if not a.dataset.is_file():
        raise SystemExit(f"tdpipe bench perplexity: --dataset: no file {a.dataset}")
    r = run(a.model, qs, a.dataset, a.window, a.max_tokens,
            {"dtype": a.dtype, "kv_cache_memory": parse_memory(a.kv_cache_memory)}, tuple(kvs))
    print(f"perplexity of {r['model']} over {r['windows']} windows of up to {r['window']} tokens of {r['dataset']}")
    print(table(r))
    if a.json:
        write_json(a.json, r)
    return 0


def add_parser(bsub: Any) -> argparse.ArgumentParser:
    """`tdpipe bench perplexity`."""
    p = bsub.add_parser("perplexity", help="token-level perplexity over a text file, per --quantization",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(fn=cmd)
    return p
