"""Logprobs in the OpenAI shapes, from RequestOutput's `{token id: Logprob}` dicts (one per position).

Completions (legacy OpenAI, as vLLM returns them): {"tokens", "token_logprobs", "top_logprobs", "text_offset"};
with echo the prompt's positions come first, the first prompt token's logprob null. Chat: {"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}]}, the top_logprobs being the top k in rank order.
"""
from __future__ import annotations

import math
from typing import Any

from tdpipe.outputs import Logprob

# what OpenAI (and vLLM) report for a token with no probability: JSON has no -Infinity (it would be a 500)
MIN_LOGPROB = -9999.0


def _lp(x: float) -> float:
    """A logprob JSON can carry: -inf (a banned token) and NaN become MIN_LOGPROB."""
    return max(x, MIN_LOGPROB) if math.isfinite(x) else (0.0 if x > 0 else MIN_LOGPROB)


def _text(tok: Any, token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tok.decode([token_id])


def completion_logprobs(tok: Any, token_ids: list[int], positions: list[dict[int, Logprob] | None], k: int,
                        offset: int = 0) -> dict[str, list]:
    """`positions[j]` holds token_ids[j]'s entry (None for a prompt's first token)."""
    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for t, entry in zip(token_ids, positions):
        lp = entry.get(t) if entry else None
        text = _text(tok, t, lp)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if lp is None else _lp(lp.logprob))
        if entry is None:
            out["top_logprobs"].append(None)
        else:
            top = sorted(((x.rank or 0, i, x) for i, x in entry.items() if (x.rank or 0) <= k or i == t),
                         key=lambda r: r[0])
            out["top_logprobs"].append({_text(tok, i, x): _lp(x.logprob) for _, i, x in top})
    return out


def chat_logprobs(tok: Any, token_ids: list[int], positions: list[dict[int, Logprob]], k: int) -> dict[str, list]:
    content = []
    for t, entry in zip(token_ids, positions):
        lp = entry.get(t)
        text = _text(tok, t, lp)
        top = sorted(((x.rank, i, x) for i, x in entry.items() if x.rank is not None and x.rank <= k),
                     key=lambda r: r[0])[:k]
        content.append({"token": text, "logprob": _lp(lp.logprob) if lp else None, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": _text(tok, i, x), "logprob": _lp(x.logprob),
                                          "bytes": list(_text(tok, i, x).encode())} for _, i, x in top]})
    return {"content": content}
