"""Tokenizer access and detokenisation; Hugging Face tokenizers do the work."""
from __future__ import annotations

from typing import Any


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_prompt(tokenizer: Any, conversation: list[dict[str, str]],
                add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """A conversation through the model's chat template: the prompt text and its token ids (the template
    carries the special tokens, so none are added again)."""
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    return text, tokenizer.encode(text, add_special_tokens=False)


class Detokenizer:
    """Finds stop strings in the growing output text without re-decoding the whole output every step."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def find_stop(self, ids: list[int], prev_text: str, stops: list[str],
                  skip_special_tokens: bool) -> tuple[str, str, int] | None:
        """Decode the output so far and look for a stop string that ends in text added since `prev_text`.
        Returns (new text, stop, index of the stop) or None (then the caller keeps the new text)."""
        text = self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        best: tuple[int, str] | None = None
        for s in stops:
            i = text.find(s, max(0, len(prev_text) - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return text, "", -1
        return text, best[1], best[0]
