"""prompt_logprobs: the logprob of every prompt token under the model, filled chunk by chunk as the prompt
is prefilled. A batch holding such a request returns one logits row per new token for it (instead of the
last one only); this turns those rows into the prompt's logprobs and hands back the one row per sequence
that sampling reads."""
from __future__ import annotations

from typing import Any

import torch

from tdpipe.sampling.sampler import Sampler, TokenLogprobs


def extend_prompt_logprobs(seq: Any, logits: torch.Tensor) -> None:
    """Append the logprobs of prompt positions start+1 .. for this chunk (start: its first token's position,
    `seq.num_computed_tokens` before the chunk is counted), skipping positions already known (a prompt
    recomputed after preemption). From the model's raw distribution: the actual next prompt token, its
    rank, the top-k."""
    start = seq.num_computed_tokens
    prompt = seq.prompt_token_ids
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]
    have = len(seq.prompt_logprobs)  # row j predicts position start + j + 1; the known ones are skipped
    js = [j for j in range(logits.shape[0]) if have <= start + j + 1 < len(prompt)]
    if js:  # a contiguous run of rows: a view, not a copy of [rows, vocab]
        out: list[TokenLogprobs] = Sampler.token_logprobs(logits[js[0]:js[-1] + 1],
                                                         [prompt[start + j + 1] for j in js],
                                                         seq.sampling_params.prompt_logprobs)
        seq.prompt_logprobs.extend(out)


def split_prompt_logits(seqs: list[Any], num_new_tokens: list[int], all_logits: list[bool],
                        logits: torch.Tensor) -> torch.Tensor:
    """`logits` laid out as sent (StepInput.all_logits: every new token's row for the flagged sequences,
    the last one for the others): record the flagged sequences' prompt logprobs and return one row per
    sequence, its last token's."""
    last: list[int] = []
    r = 0
    for seq, q, full in zip(seqs, num_new_tokens, all_logits):
        width = q if full else 1
        if full:
            extend_prompt_logprobs(seq, logits[r:r + width])
        last.append(r + width - 1)
        r += width
    return logits[last]


__all__ = ["extend_prompt_logprobs", "split_prompt_logits"]
