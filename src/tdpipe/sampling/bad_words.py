"""vLLM's `bad_words`: words the answer must not contain, banned token by token as it is generated.

Each word becomes token sequences the way vLLM tokenizes it: the word as written (leading spaces stripped),
and with one leading space when that spelling starts with another token of the same count (how a word reads
mid-sentence in a BPE vocabulary). A one-token sequence is banned at every position; a longer one bans its
last token where the answer so far ends with the rest of it. Only the generated tokens count, as in vLLM:
the prompt may end with the beginning of a bad word.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence


def bad_words_token_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token sequences of `words` (encode: text -> ids without special tokens)."""
    out: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        if bare:
            out.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return out


def bad_word_bans(sequences: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens a row may not produce next: each sequence's last token where the output ends with its
    other tokens."""
    bans = []
    for ids in sequences:
        k = len(ids) - 1
        if k == 0 or (k <= len(output_ids) and list(output_ids[len(output_ids) - k:]) == list(ids[:k])):
            bans.append(ids[-1])
    return bans


__all__ = ["bad_word_bans", "bad_words_token_ids"]
