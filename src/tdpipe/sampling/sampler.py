"""Turns a batch of last-position logits into one next token per row, each row with its own params.

Large vocabularies (Gemma 3: 262,144 columns; 256 rows of float32 logits are 268 MB): the caller's logits
are read in place and only the rows a stage needs are copied once (the rows bans or penalties change, the
random rows scaled by their temperature, the logprob rows); greedy rows take their argmax on views. Top-k /
top-p / min-p work on each row's top candidates, widening to WIDE_CANDIDATES before a full sort.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tdpipe.sampling.token_masks import apply_bitmask, masked_argmax
from tdpipe.sampling.metadata import RowRandom, SamplingMetadata
from tdpipe.sampling.params import SamplingParams
from tdpipe.sampling.race import key_tensor, kernel_rows, race, row_kernel, scaled_rows
from tdpipe.sampling.seeds import draw_key, draw_keys, sample_seed  # noqa: F401 (re-exported)

# (token id, logprob, rank) triples, the sampled token first (tdpipe.core.delta.TokenLogprobs)
TokenLogprobs = list[tuple[int, float, int]]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A stateful generator seeded with the request's seed, for callers that drive one stream themselves
    (each draw advances it). The engine does not use it: it passes `draw_key(seed, index)` per token, so
    a preempted request cannot lose or replay draws. Unseeded requests get None."""
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


CANDIDATES = 256  # top tokens per row on the fast path of top-k / top-p sampling
# Wider tries for rows whose survivors the first candidates do not hold (a flat distribution's nucleus of
# thousands of tokens), before a full sort: on a 262,144-column row topk(4096) takes ~4 ms, topk(32768)
# ~9 ms, the sort ~50 ms (one core)
WIDE_CANDIDATES = (4096, 32768)
PROMPT_LOGPROBS_CHUNK = 1 << 25  # logits elements per prompt_logprobs chunk: its float32 copies ~128 MiB each
# (a 2048-token chunk of a 262k vocabulary at once needed ~5 GiB of float32 copies; 32k tokens went OOM)


def _logsumexp(x: torch.Tensor, top: torch.Tensor, rows: torch.Tensor | None = None,
               temps: torch.Tensor | None = None) -> torch.Tensor:
    """(x[rows] / temps).logsumexp(-1) (all rows: None; no division: None) when the rows' maxima `top` [R, 1]
    are known (the first top-k value): the same operations as torch's (max, sum of exp of the difference,
    log, add back), less the pass for the max; one pass of csrc/lse.cpp per row on CPU where built (its own
    exp: float rounding apart; the rows read where they lie), else torch's with the gathered rows the one
    temporary."""
    top = top.masked_fill(top.abs() == float("inf"), 0.0)
    kern = row_kernel(x)
    if kern is not None:
        return kern.row_lse(x, *kernel_rows(x, rows, temps), top.squeeze(1).to(torch.float32).contiguous())
    if temps is not None:
        x, rows = scaled_rows(x, rows, temps), None
    y = x - top if rows is None else x[rows].sub_(top)
    return y.exp_().sum(-1).log_().add_(top.squeeze(1))


def top_candidates(x: torch.Tensor, k: int, rows: torch.Tensor | None = None,
                   temps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [R, k]: the k largest of each row of x[rows] / temps (all rows: None; no division:
    None), descending, equal values by the lower column (the order of a stable descending sort). torch.topk
    orders equal values arbitrarily, and a seeded row's draw is keyed by its candidates' positions, so the
    order is fixed: csrc/topk.cpp on CPU where built (the rows read where they lie, a threshold estimated from
    every 16th value, one vector pass: ~9 ms for 256 x 49,152 where topk took ~23), else a stable sort in
    slices of rows (the same tensors; slow)."""
    kern = row_kernel(x)
    if kern is not None:
        return kern.top_candidates(x, *kernel_rows(x, rows, temps), k)
    x = scaled_rows(x, rows, temps)
    step = max(1, PROMPT_LOGPROBS_CHUNK // max(1, x.shape[-1]))
    parts = [x[r0:r0 + step].sort(dim=-1, descending=True, stable=True) for r0 in range(0, x.shape[0], step)]
    return (torch.cat([v[:, :k] for v, _ in parts]), torch.cat([i[:, :k] for _, i in parts]))


Masks = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # candidate_masks' (vals, ids, keep, covered)


def candidate_masks(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                    k: int = CANDIDATES, rows: torch.Tensor | None = None, temps: torch.Tensor | None = None) -> Masks:
    """Top-k / top-p / min-p on each row's `k` most likely tokens instead of a sort of the whole vocabulary
    (a [128, 49152] sort takes ~0.7 s on one core; topk(256) ~0.05 s). Returns (values, ids, keep, covered):
    the candidates in descending order, which of them survive the masks, and whether the candidates hold
    every survivor (top_k <= k, or the nucleus reaches top_p inside them). Same masks as
    `apply_top_k_top_p` + `apply_min_p` for covered rows; the others need the full path. `rows` / `temps`:
    the rows are logits[rows] / temps, read where they lie (no copy)."""
    b, vocab = (logits.shape[0] if rows is None else len(rows)), logits.shape[1]
    k = min(k, vocab)
    vals, ids = top_candidates(logits, k, rows, temps)
    limit = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [B] tokens top-k keeps
    keep = torch.arange(k).unsqueeze(0) < limit.unsqueeze(1)
    within = limit <= k  # top-k alone keeps the row inside the candidates
    covered = within | (k == vocab)
    if bool((top_p < 1).any()):
        # probabilities renormalised over the top-k set (top-k applies first), else over the whole row
        # (computed only for the top-p rows without a top-k inside the candidates: a pass over the row)
        lse = vals.masked_fill(~keep, float("-inf")).logsumexp(-1)
        whole = ((top_p < 1) & ~within).nonzero().squeeze(1)
        if whole.numel():
            at = (None if whole.numel() == b else whole) if rows is None else rows[whole]
            lse[whole] = _logsumexp(logits, vals[whole, :1], at, None if temps is None else temps[whole])
        lse = lse.unsqueeze(1)
        p = (vals - lse).exp() * keep
        above = p.cumsum(-1) - p  # mass of the tokens ranked above each candidate
        nucleus = above < top_p.unsqueeze(1)
        nucleus[:, 0] = True
        keep &= nucleus | (top_p >= 1).unsqueeze(1)
        # a nucleus inside the candidates covers the row only when no top-k wider than them renormalises it
        covered |= (top_p < 1) & (limit == vocab) & (p.sum(-1) >= top_p)
    if bool((min_p > 0).any()):
        keep &= (vals - vals[:, :1]).exp() >= min_p.unsqueeze(1)  # p_j >= min_p * p_max, normalisation-free
    return vals, ids, keep, covered


class Sampler:
    """The per-row state it needs (history, random keys, bans) comes in a `SamplingMetadata`; it keeps none
    between calls."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> list[int]:
        """`sample(...)`'s tokens only."""
        return self.sample(logits, meta)[0]

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row. `meta.keys[i]`: None (unseeded: the global RNG), an int from `draw_key`
        (seeded: the row's draw depends on that key alone), or a torch.Generator the caller keeps.
        `meta.banned[i]`: token ids row i must not produce (stop tokens before min_tokens, bad words); ids
        outside the vocabulary are ignored. `meta.bitmask`: the tokens a grammar allows in
        `meta.masked_rows`. The caller's logits are never modified.

        Also log-probabilities for the rows where `meta.num_logprobs[i]` is an int k: the sampled
        token's (logprob, rank) and the top-k, from the distribution the row samples from after penalties,
        banned tokens, the grammar's mask and temperature, before top-k / top-p / min-p truncation (vLLM v0's
        processed logprobs; a greedy row's temperature is not applied)."""
        params, num_logprobs = meta.params, meta.num_logprobs
        vocab = logits.shape[-1]
        bans = [] if meta.banned is None else [(i, [t for t in b if 0 <= t < vocab]) for i, b in enumerate(meta.banned)]
        bans = [(i, b) for i, b in bans if b]
        want = [] if num_logprobs is None else [i for i, k in enumerate(num_logprobs) if k is not None]
        masked = meta.masked_rows or []
        if not masked and all(p.is_greedy and not p.needs_processing for p in params):  # hot path: plain greedy
            tokens = logits.argmax(-1).tolist()
            if bans:  # mask a copy of the banned rows only, not of the whole batch
                rows = logits[[i for i, _ in bans]].to(torch.float32)
                for k, (_, b) in enumerate(bans):
                    rows[k, b] = float("-inf")
                for (i, _), tok in zip(bans, rows.argmax(-1).tolist()):
                    tokens[i] = tok
            entries: list[TokenLogprobs | None] = [None] * len(params)
            if want:
                x = logits[want].to(torch.float32, copy=True)
                banned_rows = dict(bans)
                for j, i in enumerate(want):
                    if i in banned_rows:
                        x[j, banned_rows[i]] = float("-inf")
                self._fill_logprobs(x, tokens, want, num_logprobs, entries)
            return tokens, entries

        # The processed logits without a [B, V] copy: the rows bans, penalties or a grammar change are copied
        # and changed (`fixed`), the others read from the caller's tensor where they lie. A greedy row that only
        # a grammar changes needs no copy: its argmax over the allowed tokens is read in place (`direct`).
        pen = [i for i, p in enumerate(params) if p.needs_penalties]
        biased = [i for i, p in enumerate(params) if p.logit_bias is not None]
        only = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        banned_set, want_set = {i for i, _ in bans}, set(want)
        direct = [i for i in masked if params[i].is_greedy and not params[i].needs_processing
                  and i not in banned_set and i not in want_set]
        fix_rows = sorted(banned_set | set(pen) | set(biased) | set(only) | (set(masked) - set(direct)))
        fix_at = {i: j for j, i in enumerate(fix_rows)}
        if fix_rows:
            fixed = logits[fix_rows].to(torch.float32)
            for i in biased:  # first: a ban, the penalties and a grammar apply to the biased logits
                ids = [t for t in params[i].logit_bias if t < vocab]
                fixed[fix_at[i], ids] += torch.tensor([params[i].logit_bias[t] for t in ids])
            for i in only:  # every other token out (vLLM's allowed_token_ids)
                ids = [t for t in params[i].allowed_token_ids if t < vocab]
                keep = fixed[fix_at[i], ids].clone()
                fixed[fix_at[i]] = float("-inf")
                fixed[fix_at[i], ids] = keep
            for i, b in bans:
                fixed[fix_at[i], b] = float("-inf")
            if pen:
                at = [fix_at[i] for i in pen]
                fixed[at] = apply_penalties(
                    fixed[at],
                    [meta.prompt_ids[i] for i in pen],
                    [meta.output_ids[i] for i in pen],
                    torch.tensor([params[i].repetition_penalty for i in pen]),
                    torch.tensor([params[i].frequency_penalty for i in pen]),
                    torch.tensor([params[i].presence_penalty for i in pen]),
                )
            if len(direct) < len(masked):  # last: what a grammar forbids stays forbidden whatever penalties did
                apply_bitmask(fixed, meta.bitmask[fix_rows])  # the rows without a grammar allow everything

        def take(rows: list[int], temps: torch.Tensor) -> torch.Tensor:
            """These rows of the processed logits divided by `temps` [len(rows)]: one gathered float32 copy,
            scaled in place (a division per row into a preallocated tensor reads less, but its one parallel
            region per row stalls on a loaded machine: 3x slower with 2 threads)."""
            if all(i in fix_at for i in rows):
                out = fixed[[fix_at[i] for i in rows]]
            else:
                out = logits[rows].to(torch.float32)
                for j, i in enumerate(rows):
                    if i in fix_at:
                        out[j] = fixed[fix_at[i]]
            return out.div_(temps.unsqueeze(1))

        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        tokens = [0] * len(params)
        if direct:
            for i, tok in zip(direct, masked_argmax(logits, meta.bitmask, direct)):
                tokens[i] = tok if tok >= 0 else int(logits[i].argmax())  # a grammar allowing nothing: unmasked
        greedy_fixed = [i for i, p in enumerate(params) if p.is_greedy and i in fix_at]
        if greedy_fixed:
            for i, tok in zip(greedy_fixed, fixed[[fix_at[i] for i in greedy_fixed]].argmax(-1).tolist()):
                tokens[i] = tok
        direct_set = set(direct)
        for i, p in enumerate(params):  # the other greedy rows: an argmax of each row where it lies, no copy
            if p.is_greedy and i not in fix_at and i not in direct_set:
                tokens[i] = int(logits[i].argmax())
        def where(rows: list[int]) -> list[tuple[torch.Tensor, list[int], list[int]]]:
            """Where these rows lie unscaled: (tensor, their positions in `rows`, their indices in the tensor)
            for the caller's logits and the changed copy, each where it holds any."""
            mine = [j for j, i in enumerate(rows) if i not in fix_at]
            copied = [j for j, i in enumerate(rows) if i in fix_at]
            parts = [(logits, mine, [rows[j] for j in mine])]
            if copied:
                parts.append((fixed, copied, [fix_at[rows[j]] for j in copied]))
            return [p for p in parts if p[1]]

        def race_in_place(rows: list[int], temps: torch.Tensor, keys: torch.Tensor) -> list[int]:
            """The race over these rows of the processed logits where they lie, each divided by its temperature
            inside the kernel: the bits of take + race."""
            out = [0] * len(rows)
            for src, js, idx in where(rows):
                for j, tok in zip(js, race(src, keys[js], torch.tensor(idx), temps[js]).tolist()):
                    out[j] = tok
            return out

        def source(rows: list[int]) -> tuple[torch.Tensor, list[int]] | None:
            """Where these rows lie unscaled, when in one tensor: (tensor, their indices in it); else None."""
            parts = where(rows)
            return (parts[0][0], parts[0][2]) if len(parts) == 1 else None

        if rows:
            sampled = self._sample(lambda js, temps: take([rows[j] for j in js], temps),
                                   lambda js, temps, keys: race_in_place([rows[j] for j in js], temps, keys),
                                   lambda js: source([rows[j] for j in js]),
                                   [params[i] for i in rows], [meta.keys[i] for i in rows])
            for i, tok in zip(rows, sampled):
                tokens[i] = tok
        entries = [None] * len(params)
        if want:
            temps = torch.tensor([1.0 if params[i].is_greedy else params[i].temperature for i in want])
            self._fill_logprobs(take(want, temps), tokens, want, num_logprobs, entries)
        return tokens, entries

    @staticmethod
    def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
        """Per row of `logits` (the model's raw distribution): the logprob and rank of `token_ids[row]`, then
        the row's top-k. What prompt_logprobs reports for each prompt position."""
        out: list[TokenLogprobs | None] = []
        step = max(1, PROMPT_LOGPROBS_CHUNK // max(1, logits.shape[-1]))
        for r0 in range(0, len(token_ids), step):  # a chunk's float32 log_softmax stays ~128 MiB
            part: list[TokenLogprobs | None] = [None] * min(step, len(token_ids) - r0)
            rows = list(range(len(part)))
            Sampler._fill_logprobs(logits[r0:r0 + len(part)].to(torch.float32), token_ids[r0:r0 + len(part)],
                                   rows, [k] * len(rows), part)
            out += part
        return out  # type: ignore[return-value]

    @staticmethod
    def _fill_logprobs(x: torch.Tensor, tokens: list[int], rows: list[int], ks: list[int | None],
                       out: list[TokenLogprobs | None]) -> None:
        """log_softmax of x (the `rows`' processed logits, float32): each row's sampled token with its rank
        (1 + tokens strictly more likely), then its top-k in rank order."""
        lp = torch.log_softmax(x, dim=-1)
        chosen_ids = torch.tensor([tokens[i] for i in rows])
        chosen = lp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
        ranks = ((lp > chosen.unsqueeze(1)).sum(-1) + 1).tolist()
        kmax = max(ks[i] for i in rows)
        top_v, top_i = (lp.topk(kmax, dim=-1) if kmax else (None, None))
        chosen_l = chosen.tolist()
        for j, i in enumerate(rows):
            entry = [(tokens[i], chosen_l[j], ranks[j])]
            k = ks[i]
            if k:
                entry += [(t, v, r + 1) for r, (t, v) in enumerate(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist()))]
            out[i] = entry

    def _sample(self, take: Callable[[list[int], torch.Tensor], torch.Tensor],
                in_place: Callable[[list[int], torch.Tensor, torch.Tensor], list[int]],
                source: Callable[[list[int]], tuple[torch.Tensor, list[int]] | None], params: list[SamplingParams],
                generators: list[RowRandom]) -> list[int]:
        """Temperature, then top-k / top-p / min-p on the candidate fast path where a row has top-k or top-p
        and its survivors lie within its top CANDIDATES tokens; the plain rows (temperature alone, a key) race
        where their logits lie; every other row takes the full path. `take(rows, temps)`: those rows' logits
        divided by their temperatures, a new float32 tensor; `in_place(rows, temps, keys)`: their race
        without that copy (the same tokens); `source(rows)`: the tensor they lie in unscaled and their indices
        there, when one holds them all (the candidates are then taken without the copy)."""
        n = len(params)

        def scaled(rows: list[int]) -> torch.Tensor:
            return take(rows, torch.tensor([params[i].temperature for i in rows], dtype=torch.float32))

        tokens = [0] * n
        rest, rest_x = list(range(n)), None
        fast = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1]
        if fast:
            sub = [params[i] for i in fast]
            temps = torch.tensor([p.temperature for p in sub], dtype=torch.float32)
            src = source(fast)
            # the rows where they lie, divided inside the kernels; a scaled copy where they lie in two tensors
            x = scaled(fast) if src is None else None
            vocab = (x if x is not None else src[0]).shape[-1]
            masks = (torch.tensor([min(p.top_k, vocab) for p in sub]), torch.tensor([p.top_p for p in sub]),
                     torch.tensor([p.min_p for p in sub]))
            vals, ids, keep, covered = (candidate_masks(x, *masks) if x is not None else
                                        candidate_masks(src[0], *masks, rows=torch.tensor(src[1]), temps=temps))
            rows = [j for j, c in enumerate(covered.tolist()) if c]
            if rows:
                picked = self._race(vals[rows].masked_fill(~keep[rows], float("-inf")),
                                    [generators[fast[j]] for j in rows])
                for j, c in zip(rows, picked):
                    tokens[fast[j]] = int(ids[j, c])
            done = {fast[j] for j in rows}
            left = [j for j in range(len(fast)) if fast[j] not in done]
            rest = [i for i in range(n) if i not in done]
            if x is not None and len(left) == len(rest):  # all uncovered fast rows: reuse their scaled logits
                rest_x = x if len(left) == len(fast) else x[left]
            del x
        plain = [i for i in rest if params[i].top_k <= 0 and params[i].top_p >= 1 and params[i].min_p <= 0
                 and not isinstance(generators[i], torch.Generator)]
        if plain:
            keys = self._keys([generators[i] for i in plain])
            temps = torch.tensor([params[i].temperature for i in plain], dtype=torch.float32)
            for i, t in zip(plain, in_place(plain, temps, keys)):
                tokens[i] = t
            gone = set(plain)
            rest = [i for i in rest if i not in gone]
        if rest:
            sub = rest_x if rest_x is not None else scaled(rest)  # rest_x: no plain row among them
            del rest_x
            for i, t in zip(rest, self._sample_full(sub, [params[i] for i in rest], [generators[i] for i in rest])):
                tokens[i] = t
        return tokens

    @staticmethod
    def _keys(generators: list[RowRandom]) -> torch.Tensor:
        """int64 race keys of rows whose randomness is a key (seeded) or None (unseeded: one draw of torch's
        global generator per call, mixed per row, so torch.manual_seed repeats a run); 0 for a Generator row."""
        keys = [0 if isinstance(g, torch.Generator) else g for g in generators]
        unseeded = [i for i, g in enumerate(keys) if g is None]
        if unseeded:
            base = int(torch.randint(0, 1 << 62, ()))
            for i, key in zip(unseeded, draw_keys([base] * len(unseeded), unseeded)):
                keys[i] = key
        return key_tensor(keys)

    def _race(self, x: torch.Tensor, generators: list[RowRandom]) -> list[int]:
        """Exponential race on float32 logits already divided by their temperatures (masked tokens -inf):
        argmax(x - ln q), q ~ Exp(1), picks column j with probability softmax(x)_j (sampling/race.py). A seeded
        row's noise is hashed from its key and the column, so its draw depends on nothing but (seed, output
        index) and the number of columns. Robust to logits a few ulps apart (the same request in a batch of
        another shape): the winner changes only on a near tie. Inverse-CDF sampling (one uniform per row)
        needs one pass too, but in vocabulary order a draw landing among tail tokens moves with any ulp-level
        shift of the cumulative sum, so a seeded request's tokens then depended on what shared its batch. A
        torch.Generator (a caller's own stream) draws its row's noise from it with `exponential_`."""
        tokens = race(x, self._keys(generators)).tolist()
        for i, g in enumerate(generators):
            if isinstance(g, torch.Generator):
                q = torch.empty(x.shape[1], dtype=torch.float32).exponential_(generator=g)
                q = q.to(x.device).clamp_min_(torch.finfo(q.dtype).tiny)  # a zero draw: ln 0 = -inf
                tokens[i] = int((x[i].float() - q.log()).argmax())
        return tokens

    def _sample_full(self, logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[RowRandom]) -> list[int]:
        """The whole vocabulary: the race over every token (in vocabulary order, so a seeded row draws one
        value per column as it always has). A top-k / top-p row's masks come from its WIDE_CANDIDATES top
        tokens where they hold its survivors, the other rows' from a full sort."""
        vocab = logits.shape[-1]
        xs: torch.Tensor | None = None  # the rows' logits after their masks (-inf), what the race reads
        rest = list(range(len(params)))
        for k in WIDE_CANDIDATES:
            wide = [i for i in rest if params[i].top_k > 0 or params[i].top_p < 1]
            if not wide or k >= vocab:
                break
            sub = [params[i] for i in wide]
            vals, ids, keep, covered = candidate_masks(
                logits if len(wide) == len(params) else logits[wide],
                torch.tensor([min(p.top_k, vocab) for p in sub]), torch.tensor([p.top_p for p in sub]),
                torch.tensor([p.min_p for p in sub]), k=k)
            hit = covered.nonzero().squeeze(1)
            if hit.numel():
                got = vals[hit].masked_fill(~keep[hit], float("-inf"))
                if xs is None:
                    xs = torch.full_like(logits, float("-inf"))
                at = torch.tensor(wide)[hit]
                xs[at] = torch.full((len(at), vocab), float("-inf")).scatter_(1, ids[hit], got)
                done = set(at.tolist())
                rest = [i for i in rest if i not in done]
        if rest:
            sub = [params[i] for i in rest]
            x = logits if len(rest) == len(params) else logits[rest]
            top_k = (torch.tensor([min(p.top_k, vocab) for p in sub]) if any(p.top_k > 0 for p in sub)
                     else None)
            top_p = torch.tensor([p.top_p for p in sub]) if any(p.top_p < 1 for p in sub) else None
            x = apply_top_k_top_p(x, top_k, top_p)
            if any(p.min_p > 0 for p in sub):
                x = apply_min_p(x, torch.tensor([p.min_p for p in sub]))
            if xs is None:
                xs = x
            else:
                xs[rest] = x
        return self._race(xs, generators)
