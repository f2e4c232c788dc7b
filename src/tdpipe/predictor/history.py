"""The request history the predictor learns from: one JSON object per finished request (JSONL).

tdpipe writes it itself (`--record-history FILE` on generate/bench, `LLM(record_history=...)`): the prompt
text, its token count, the output token count, the finish reason, the sampling params and the model. Only
requests that ended naturally ("stop") say how long the model wants to answer; "length" rows are capped.
`load_sharegpt` turns the ShareGPT JSON format (the paper's dataset) into the same records.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable


@dataclass
class HistoryRecord:
    prompt: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str = "stop"
    sampling_params: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    request_id: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "") -> "HistoryRecord":
        for k in ("prompt", "prompt_tokens", "output_tokens"):
            if k not in d:
                raise ValueError(f"{where}: history record lacks the field {k!r}")
        if not isinstance(d["output_tokens"], int) or d["output_tokens"] < 0:
            raise ValueError(f"{where}: output_tokens must be an integer >= 0, got {d['output_tokens']!r}")
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class HistoryWriter:
    """Appends records to a JSONL file, one line per finished request, flushed as they come (nothing lost
    if the run stops half way)."""

    def __init__(self, path: str, model: str = "") -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.model = model
        self._f = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self.count = 0

    def write(self, rec: HistoryRecord) -> None:
        if not rec.model:
            rec.model = self.model
        line = json.dumps(asdict(rec), ensure_ascii=False)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()
            self.count += 1

    def close(self) -> None:
        self._f.close()


def load_history(path: str, natural_only: bool = False) -> list[HistoryRecord]:
    """All records of a JSONL history; `natural_only`: just the requests that stopped by themselves."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
                out.append(HistoryRecord.from_dict(d, f"{path}:{i}"))
    if natural_only:
        out = [r for r in out if r.finish_reason == "stop"]
    if not out:
        raise ValueError(f"{path}: no history records{' that stopped naturally' if natural_only else ''}")
    return out


def load_sharegpt(path: str, count_tokens: Callable[[str], int], model: str = "sharegpt") -> list[HistoryRecord]:
    """ShareGPT JSON ([{"id", "conversations": [{"from": "human"|"gpt", "value"}, ...]}, ...]): each human turn
    followed by a gpt turn becomes a record, the gpt turn's token count (by `count_tokens`, the serving
    model's tokenizer) its output length. Conversations without such a pair are skipped."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: ShareGPT JSON must be a list of conversations")
    out = []
    for conv in data:
        turns = conv.get("conversations") or []
        for q, a in zip(turns, turns[1:]):
            if q.get("from") == "human" and a.get("from") == "gpt" and q.get("value") and a.get("value"):
                out.append(HistoryRecord(q["value"], count_tokens(q["value"]), count_tokens(a["value"]),
                                         "stop", {}, model, str(conv.get("id", ""))))
    if not out:
        raise ValueError(f"{path}: no human/gpt turn pairs found")
    return out
