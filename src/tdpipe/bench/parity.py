"""Greedy parity of the engine with transformers, and the judgement of a divergence.

In float32 the engine and transformers must produce the same greedy tokens. In bfloat16 two correct
implementations may not: they round in different orders (fused kernels, split-K attention, another GEMM
tiling), and where the two best tokens' logits nearly tie, the argmax can flip; after the first flip the
streams are unrelated. So a bf16 divergence is accepted only when the reference itself can barely tell the
two tokens apart: at the first divergent position, under the float32 reference model fed the common prefix,
the gap between transformers' token and the engine's token is at most TIE_ABS + TIE_REL * |top logit|.
Every divergence records that gap and the top-2 margin of the same-dtype reference logits, so a reader can
judge the call instead of trusting it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

TIE_ABS = 0.1  # logits: ~ the bf16 spacing of a logit of magnitude 16-32 (2^-7 relative, 0.125 at 16)
TIE_REL = 0.01  # of |top logit|: bf16 keeps 8 significant bits, and the error grows over the layers

# Parity prompts: short, ordinary text, so a real model's distributions are peaked (random ids make ties common)
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "The largest planet in the solar system is",
)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where the two token streams differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(logits: Sequence[float]) -> float:
    """Top logit minus the second: how decisive the argmax was."""
    first = second = float("-inf")
    for v in logits:
        if v > first:
            first, second = v, first
        elif v > second:
            second = v
    return first - second


def near_tie(logits: Sequence[float], ref_token: int, engine_token: int) -> tuple[float, bool]:
    """(gap, is it a near-tie): the reference's logit of its own token minus that of the engine's token."""
    gap = float(logits[ref_token]) - float(logits[engine_token])
    top = max(float(v) for v in logits)
    return gap, abs(gap) <= TIE_ABS + TIE_REL * abs(top)


LogitsFn = Callable[[list[int]], list[float]]  # next-token logits after these token ids


def compare(prompts: list[list[int]], engine: list[list[int]], reference: list[list[int]], exact: bool,
            ref_logits: LogitsFn | None = None, tie_logits: LogitsFn | None = None) -> dict[str, Any]:
    """Compare the engine's greedy streams with the reference's, prompt by prompt.

    exact: every stream must be identical (float32). Otherwise a divergence passes when `tie_logits` (the
    float32 reference) shows a near-tie there; `ref_logits` (the same-dtype reference) gives the top-2
    margin that is recorded beside it."""
    rows = []
    for k, (p, e, r) in enumerate(zip(prompts, engine, reference, strict=True)):
        at = first_divergence(e, r)
        row: dict[str, Any] = {"prompt": k, "tokens": len(r), "identical": at is None}
        if at is not None:
            row |= {"position": at, "engine_token": e[at] if at < len(e) else None,
                    "reference_token": r[at] if at < len(r) else None}
            prefix = list(p) + list(r[:at])
            if ref_logits is not None and row["reference_token"] is not None:
                row["top2_margin"] = top2_margin(ref_logits(prefix))
            if tie_logits is not None and None not in (row["engine_token"], row["reference_token"]):
                row["fp32_gap"], row["near_tie"] = near_tie(tie_logits(prefix), row["reference_token"],
                                                            row["engine_token"])
            else:
                row["near_tie"] = False
        rows.append(row)
    identical = sum(r["identical"] for r in rows)
    explained = all(r["identical"] or r.get("near_tie") for r in rows)
    return {"prompts": len(rows), "identical": identical, "rows": rows,
            "rule": "identical" if exact else f"identical, or the first divergence a near-tie (|fp32 gap| <= "
                                              f"{TIE_ABS} + {TIE_REL} x |top logit|)",
            "passed": identical == len(rows) if exact else explained}


def hf_greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone (unpadded): the oracle, exactly n tokens.

    A plain argmax loop over the model's KV cache rather than `generate(min_new_tokens=n)`: that masks the
    EOS logit until n tokens, while the engine's `ignore_eos` (as vLLM's) only keeps going after an EOS, so
    the two would part wherever EOS is the argmax."""
    import inspect

    import torch

    dev = next(model.parameters()).device
    # the KV cache's keyword (and output field): `cache` from transformers 5.24, which deprecates the older
    # `past_key_values` (to be removed in 5.40); the pin allows both
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    for p in prompts:
        ids, cache, got = torch.tensor([p], device=dev), None, []
        with torch.inference_mode():
            for _ in range(n):
                o = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
                cache, tok = getattr(o, kw), int(o.logits[0, -1].argmax())
                got.append(tok)
                ids = torch.tensor([[tok]], device=dev)
        out.append(got)
    return out


def hf_logits_fn(model: Any) -> LogitsFn:
    """Next-token logits (float32 list) of a transformers model after the given ids."""
    import torch

    dev = next(model.parameters()).device

    def logits(ids: list[int]) -> list[float]:
        with torch.inference_mode():
            return model(torch.tensor([ids], device=dev)).logits[0, -1].float().tolist()

    return logits


__all__ = ["PROMPTS", "TIE_ABS", "TIE_REL", "compare", "first_divergence", "hf_greedy", "hf_logits_fn", "near_tie",
           "top2_margin"]
