"""Tokenizer access and detokenisation; Hugging Face tokenizers do the work."""
from __future__ import annotations

import os
from typing import Any

# Any one of these holds a vocabulary transformers can build a tokenizer from (vocab.json also needs
# merges.txt). tokenizer_config.json alone does not: transformers then falls back to a slow class and
# reports a missing optional package ("install sentencepiece"), which sends the user the wrong way.
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                "vocab.txt")


def check_tokenizer_files(path: str) -> None:
    """Fail with the folder and the missing file names when a model folder has no tokenizer."""
    from tdpipe.model.weights import MissingModelFile

    if not os.path.isdir(path):
        raise MissingModelFile(f"model folder {path} does not exist (no tokenizer to load)")
    present = set(os.listdir(path))
    if not present & set(_VOCAB_FILES):
        raise MissingModelFile(f"model folder {path} has no tokenizer files: none of tokenizer.json, "
                               "tokenizer.model or vocab.json + merges.txt (copy them from the model's "
                               "original folder)")
    if present & set(_VOCAB_FILES) == {"vocab.json"} and "merges.txt" not in present:
        raise MissingModelFile(f"model folder {path} has vocab.json but no merges.txt: the tokenizer needs both")


def load_tokenizer(path: str) -> Any:
    """The folder's Hugging Face tokenizer. A missing or damaged tokenizer is a ModelFileError naming the
    folder (one line in the CLI), never a transformers traceback."""
    from transformers import AutoTokenizer

    from tdpipe.model.weights import ModelFileError

    check_tokenizer_files(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers/tokenizers raise many types for a bad file
        msg = (" ".join(str(e).split()) or type(e).__name__)[:300]
        raise ModelFileError(f"cannot load the tokenizer in {path} (damaged tokenizer files?): {msg}") from None


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
