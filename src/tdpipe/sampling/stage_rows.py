"""Which rows the last stage samples, and how the engine puts its tokens together with its own (the engine
side of --sampling-device; sampling/device_sampler.py is the stage side).

--sampling-device engine: SiPipe §5.1's CPU sampling. The last stage sends argmax ids for a batch whose rows
    are all greedy, else the logits of every row, and the engine samples while the stages run the other
    micro-batches. What tdpipe has always done; `auto` on CPU.
--sampling-device stage: the last stage also samples plain-temperature rows (Gumbel-max on the device) and
    sends ids. A batch that mixes them with rows the engine must sample is split: in the engine's process
    (--pp 1 --tp 1) the stage sends ids for its rows and the logits of the others only; behind a pipeline
    the whole batch's logits go to the engine, as with `engine`. `auto` on CUDA.
A row is plain when its token depends on nothing but its logits and temperature: no top-k / top-p / min-p,
no penalties, no logprobs, no grammar, no stop-token ban (min_tokens reached), no prompt logprobs, one draw
(not the first token of an n > 1 request) and no seed: a seeded request keeps the engine's keyed stream, so
its tokens do not depend on where it was sampled.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tdpipe.config import SAMPLING_DEVICES
from tdpipe.sampling.metadata import may_argmax


def samples_on_stage(mode: str, device: str) -> bool:
    """--sampling-device on a resolved device ("cpu" | "cuda"): auto = stage on CUDA, engine on CPU."""
    if mode not in SAMPLING_DEVICES:
        raise ValueError(f"sampling_device must be one of {', '.join(SAMPLING_DEVICES)}, got {mode!r}")
    return mode == "stage" or (mode == "auto" and device.startswith("cuda"))


def stage_temperature(seq: Any) -> float | None:
    """The temperature the last stage samples `seq`'s next token at (0.0: its argmax), or None: the engine
    samples it."""
    if may_argmax(seq):
        return 0.0
    p = seq.sampling_params
    plain = (p.plain_draw and len(seq.output_token_ids) >= p.min_tokens
             and (p.prompt_logprobs is None or not seq.needs_prompt_logits)
             and (seq.group is None or len(seq.group.draws(seq)) == 1))
    return p.temperature if plain else None


def stage_rows(seqs: list[Any], on_stage: bool) -> tuple[list[bool], list[float]]:
    """(greedy_rows, temperatures) of a step (StepInput's fields): whether the last stage picks each row's
    token and, with stage sampling, at which temperature ([]: argmax, the engine-sampling behaviour)."""
    if not on_stage:
        return [may_argmax(s) for s in seqs], []
    temps = [stage_temperature(s) for s in seqs]
    return [t is not None for t in temps], [0.0 if t is None else t for t in temps]


def stage_seed(temperatures: list[float]) -> int:
    """The seed of a step's device draws, from the engine's generator (--seed): 0 when no row draws."""
    if not any(t > 0 for t in temperatures):
        return 0
    return int(torch.randint(0, 1 << 62, ()))


def split_rows(greedy_rows: list[bool], temperatures: list[float], all_logits: list[bool]) -> bool:
    """Whether an in-process stage splits this batch (ids for its rows, logits of the others): stage
    sampling asked for, some rows but not all the stage's, no prompt-logprobs layout."""
    return bool(temperatures) and any(greedy_rows) and not all(greedy_rows) and not any(all_logits)


Sampled = tuple[list[int], list[Any]]


def stage_tokens(token_ids: list[int], logits: torch.Tensor | None, idx: list[int], samples: list[Any],
                 sample: Callable[[list[Any], torch.Tensor], Sampled]) -> Sampled:
    """Tokens for `samples` (row idx[j] each) from a result with ids: the stage's, or where it left -1 (a
    split batch) the engine's `sample(samples, logits)`, whose `logits` hold just those rows in row order."""
    tokens = [token_ids[i] for i in idx]
    lps: list[Any] = [None] * len(idx)
    if logits is None:
        return tokens, lps
    logit_row: dict[int, int] = {}
    for r, t in enumerate(token_ids):
        if t < 0:
            logit_row[r] = len(logit_row)
    mine = [j for j, i in enumerate(idx) if token_ids[i] < 0]
    if mine:
        toks, got = sample([samples[j] for j in mine], logits[[logit_row[idx[j]] for j in mine]])
        for j, t, lp in zip(mine, toks, got):
            tokens[j], lps[j] = t, lp
    return tokens, lps


__all__ = ["SAMPLING_DEVICES", "samples_on_stage", "split_rows", "stage_rows", "stage_seed", "stage_temperature",
           "stage_tokens"]
