"""Reasoning on /v1/chat/completions, as vLLM's --reasoning-parser serves it: a thinking model's answer opens
with its reasoning, `<think> ... </think>`, which goes to the message's `reasoning` field; the rest is the
content (and the tool calls, when tools are parsed: tool_calls.py reads only the content).

  deepseek_r1  reasoning until </think>; the opening <think> may be missing (the template wrote it into the
               prompt); an answer without </think> is all reasoning, cut off before its content.
  qwen3        the same, and a <tool_call> inside the reasoning ends it (the call is content); with
               chat_template_kwargs {"enable_thinking": false} there is no reasoning at all.

A request's `include_reasoning: false` (vLLM's field) drops the reasoning from the answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tdpipe.entrypoints.openai.tool_calls import TOOL_OPEN, partial_suffix

THINK_START, THINK_END = "<think>", "</think>"


def _markers(parser: str) -> tuple[str, ...]:
    return (THINK_START, THINK_END, TOOL_OPEN) if parser == "qwen3" else (THINK_START, THINK_END)


def split(parser: str, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; content None when the answer ended inside its reasoning."""
    if not thinking:
        return None, text
    s = ReasoningStream(parser)
    reasoning, content = s.feed(text)
    reasoning += s.finish()
    return reasoning, (content or None) if not s.in_reasoning else None


@dataclass
class ReasoningStream:
    """The streamed form of split: text in, (reasoning delta, content delta) out. In the reasoning an
    opening <think> is dropped, </think> ends it, and for qwen3 a <tool_call> ends it too (the call is
    content); a trailing prefix of any of these is held back until the next text decides."""

    parser: str
    thinking: bool = True
    held: str = ""

    def __post_init__(self) -> None:
        self.in_reasoning = self.thinking

    def feed(self, delta: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", delta
        self.held += delta
        reasoning = ""
        while True:
            hits = [(i, m) for m in _markers(self.parser) if (i := self.held.find(m)) >= 0]
            if not hits:
                keep = max(partial_suffix(self.held, m) for m in _markers(self.parser))
                cut = len(self.held) - keep
                reasoning, self.held = reasoning + self.held[:cut], self.held[cut:]
                return reasoning, ""
            i, m = min(hits)
            reasoning += self.held[:i]
            if m == THINK_START:  # the opening tag (or a repeat of it): not text
                self.held = self.held[i + len(m):]
                continue
            rest = self.held[i + len(m):] if m == THINK_END else self.held[i:]  # a call stays content
            self.held, self.in_reasoning = "", False
            return reasoning, rest

    def finish(self) -> str:
        """What is still held: reasoning (the answer ended inside it)."""
        held, self.held = self.held, ""
        return held


def count_tokens(parser: str, token_ids: list[int], tokenizer: object, thinking: bool = True) -> int:
    """The answer's reasoning tokens (usage.completion_tokens_details.reasoning_tokens, as vLLM reports with
    a reasoning parser): those before the first end marker, the opening <think> not counted; all of them when
    the answer ended inside its reasoning. By token id where the markers are single tokens (Qwen3's and
    DeepSeek-R1's tokenizers), else the reasoning text tokenised again."""
    if not thinking or not token_ids:
        return 0
    ids = [_single_id(tokenizer, m) for m in _markers(parser)]
    start, ends = ids[0], set(ids[1:])
    if None in ends:  # a marker spans several tokens: the reasoning's text tokenised again
        tok: Any = tokenizer
        reasoning, _ = split(parser, tok.decode(token_ids, skip_special_tokens=False))
        return len(tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    count = 0
    for t in token_ids:
        if t in ends:
            break
        count += t != start
    return count


def _single_id(tokenizer: object, marker: str) -> int | None:
    """The marker's token id where the tokenizer has it as one token, else None."""
    try:
        tid = tokenizer.convert_tokens_to_ids(marker)  # type: ignore[attr-defined]
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    if not isinstance(tid, int) or tid < 0 or tid == getattr(tokenizer, "unk_token_id", None):
        return None
    return tid


__all__ = ["ReasoningStream", "count_tokens", "split"]
