"""Turns a batch of last-position logits into one next token per row, each row with its own params."""

import torch

from tdpipe.sampling.params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """One CPU generator per seeded request, created at admission and kept for its whole life,
    so its tokens do not depend on what else shares the batch. Unseeded requests get None."""
    if params.seed is None:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed)
    return g


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] occurrence counts. Rows are padded with id V, an extra bin sliced off afterwards."""
    width = max((len(t) for t in token_lists), default=0)
    ids = torch.full((len(token_lists), width), vocab_size, dtype=torch.long)
    for i, toks in enumerate(token_lists):
        ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    ids = ids.to(device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
) -> torch.Tensor:
    """Return penalised [B, V] float logits; the penalty tensors are [B].
    Repetition (HF): over prompt and output tokens, shrink positive logits and grow negative ones.
    Frequency/presence (OpenAI): over output tokens only, subtract per-count and once-seen terms."""
    vocab_size = logits.shape[-1]
    out_counts = _token_counts(output_ids, vocab_size, logits.device)
    seen = (_token_counts(prompt_ids, vocab_size, logits.device) + out_counts) > 0
    rep = repetition_penalty.to(logits).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency_penalty.to(logits).unsqueeze(1) * out_counts
    return logits - presence_penalty.to(logits).unsqueeze(1) * (out_counts > 0)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) all but each row's top_k tokens, then all but the smallest set of most likely
    tokens whose probability reaches top_p. top_k [B] long (<= 0 disables), top_p [B] float (1 disables).
    One ascending sort serves both masks. Top-k keeps exactly k even with ties."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, stable=True)  # ascending: the kept tokens are at the end
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size).to(logits.device)
        positions = torch.arange(vocab_size, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(positions < (vocab_size - k).unsqueeze(1), float("-inf"))
    if top_p is not None:
        # A token is dropped when the mass at or below it is <= 1 - p, i.e. the tokens above it already reach p.
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p.to(cum)).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p [B] times their row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.to(probs).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    """Stateless: the per-request state it needs (history, generators) is passed in by the engine."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        if all(p.is_greedy and not p.needs_penalties for p in params):
            return logits.argmax(-1).tolist()  # hot path: plain greedy decoding

        logits = logits.to(torch.float32, copy=True)
        rows = [i for i, p in enumerate(params) if p.needs_penalties]
        if rows:
            logits[rows] = apply_penalties(
                logits[rows],
                [prompt_ids[i] for i in rows],
                [output_ids[i] for i in rows],
                torch.tensor([params[i].repetition_penalty for i in rows]),
                torch.tensor([params[i].frequency_penalty for i in rows]),
                torch.tensor([params[i].presence_penalty for i in rows]),
            )

        tokens = logits.argmax(-1).tolist()  # greedy rows' answer; random rows overwrite theirs below
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if rows:
            sampled = self._sample(logits[rows], [params[i] for i in rows], [generators[i] for i in rows])
            for i, tok in zip(rows, sampled):
                tokens[i] = tok
        return tokens

    @staticmethod
    def _sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
        """Temperature, top-k/top-p, min-p, then an exponential race: argmax(p / q), q ~ Exp(1),
        picks token j with probability p_j and lets each row draw its noise from its own generator."""
        device = logits.device
        logits = logits / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        top_k = torch.tensor([p.top_k for p in params]) if any(p.top_k > 0 for p in params) else None
        top_p = torch.tensor([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None
        logits = apply_top_k_top_p(logits, top_k, top_p)
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params]))
        probs = logits.softmax(dim=-1)

        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            q[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_()
        for i, g in enumerate(generators):
            if g is not None:  # always exactly V draws per step, whatever the batch looks like
                q[i] = torch.empty(probs.shape[1]).exponential_(generator=g).to(device)
        q.clamp_min_(torch.finfo(q.dtype).tiny)  # a zero draw would turn a masked token's 0/0 into NaN
        return (probs / q).argmax(dim=-1).tolist()
