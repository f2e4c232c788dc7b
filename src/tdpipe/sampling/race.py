"""The exponential race with counter-based noise, on logits: the token of row r is argmax_j x_j / t - ln q_j,
q_j ~ Exp(1) i.i.d. That is argmax_j p_j / q_j with p = softmax(x / t), which picks column j with probability p_j
(the race of independent exponential clocks of rates p_j), taken in logs: no softmax, and the rows are read
where they lie (the caller's logits, fp32 or bf16, a list of row indices and a temperature per row).

The noise is a hash of (row key, column j), not a generator's stream: a row's draw depends on its key and the
number of columns alone, never on which rows share the batch or the order they are drawn in, and the rows
split over threads freely. torch's `exponential_` draws from a sequential Mersenne twister with a libm log
per value: 240 ms for 256 rows of 49,152 columns on this project's 2-core machine, more than a decode step.
`csrc/race.cpp` scores a row in one vector pass; `race_reference` below makes the same float32 operations
in the same order in torch (any device), so both give the same tokens bit for bit (tested).

Per column: a = fmix32(j * 0x9e3779b9 + k0), hi = fmix32(a ^ k1), lo = fmix32(a + k1 + 0x632be5ab) with
(k0, k1) the key's 32-bit halves and fmix32 murmur3's finaliser; v = hi 2^-32 + (lo + 1/2) 2^-64 in (0, 1);
q = -ln(1 - v) (by its series below v = 2^-7, where 1 - v in float32 would drop the bits that decide the
race); ln by 2 atanh((m - 1) / (m + 1)) on the mantissa m; score x / t - ln q. A row of -inf (nothing allowed)
gives column 0; a NaN logit wins (torch's argmax rule).
"""
from __future__ import annotations

import torch

from tdpipe.model import cpu_ops

M32 = 0xFFFFFFFF
REFERENCE_ELEMENTS = 1 << 21  # probs elements per chunk of the torch reference (its int64 temporaries)


def _f(hex_value: str) -> float:
    """A float32 constant exactly as race.cpp spells it (hex: no decimal double rounding on either side)."""
    return float.fromhex(hex_value)


# the constants of race.cpp, float32 values
_C = {name: _f(h) for name, h in {
    "two_m32": "0x1p-32", "two_m64": "0x1p-64", "half": "0x1p-1", "quarter": "0x1p-2", "third": "0x1.555556p-2",
    "fifth": "0x1.99999ap-3", "seventh": "0x1.24924ap-3", "ninth": "0x1.c71c72p-4", "sqrt2": "0x1.6a09e6p+0",
    "ln2": "0x1.62e430p-1", "small": "0x1p-7"}.items()}


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int64 tensors holding uint32 values (products wrap in int64; the low 32 bits
    are the uint32 product's)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _ln(y: torch.Tensor) -> torch.Tensor:
    """race.cpp's ln: ln y for a positive normal float32 y (0 gives about -88)."""
    c = {k: torch.tensor(v, dtype=torch.float32, device=y.device) for k, v in _C.items()}
    b = y.view(torch.int32).to(torch.int64) & M32
    e = ((b >> 23) & 0xFF) - 127
    m = ((b & 0x007FFFFF) | 0x3F800000).to(torch.int32).view(torch.float32)
    big = m > c["sqrt2"]
    m = torch.where(big, m * c["half"], m)
    e = torch.where(big, e + 1, e)
    one = torch.ones((), dtype=torch.float32, device=y.device)
    t = (m - one) / (m + one)
    t2 = t * t
    p = t2 * c["ninth"]
    p = p + c["seventh"]
    p = p * t2
    p = p + c["fifth"]
    p = p * t2
    p = p + c["third"]
    p = p * t2
    p = p + one
    lnm = (t * p) * 2.0
    return e.to(torch.float32) * c["ln2"] + lnm


def race_scores(x: torch.Tensor, keys: torch.Tensor, col0: int = 0) -> torch.Tensor:
    """x - ln q for float32 `x` [R, C] (already divided by the temperature; columns col0 .. col0 + C of their
    rows) with the rows' int64 `keys`."""
    dev = x.device
    c = {k: torch.tensor(v, dtype=torch.float32, device=dev) for k, v in _C.items()}
    k = keys.to(device=dev, dtype=torch.int64)
    k0, k1 = (k & M32)[:, None], ((k >> 32) & M32)[:, None]
    j = torch.arange(col0, col0 + x.shape[1], dtype=torch.int64, device=dev)[None, :]
    a = _fmix32(((j * 0x9E3779B9) + k0) & M32)
    hi = _fmix32(a ^ k1)
    lo = _fmix32((a + k1 + 0x632BE5AB) & M32)
    v = hi.to(torch.float32) * c["two_m32"]
    v = v + (lo.to(torch.float32) + c["half"]) * c["two_m64"]
    s = v * c["quarter"]
    s = s + c["third"]
    s = s * v
    s = s + c["half"]
    s = s * v
    s = s + 1.0
    q_small = v * s
    q_log = 0.0 - _ln(1.0 - v)
    q = torch.where(v < c["small"], q_small, q_log)
    return x - _ln(q)


def race_reference(x: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor | None = None,
                   temps: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R]: race.cpp's race_rows in torch, on any device. Each listed row's (all rows: None) first index
    of the largest x / t - ln q (torch's argmax: the first NaN wins), in chunks of rows and columns so the
    temporaries stay ~100 MiB whatever the vocabulary."""
    idx = torch.arange(x.shape[0]) if rows is None else rows
    n, cols = len(idx), x.shape[1]
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    step_c = min(cols, REFERENCE_ELEMENTS)
    step_r = max(1, REFERENCE_ELEMENTS // step_c)
    for r0 in range(0, n, step_r):
        sub = idx[r0:r0 + step_r].to(x.device)
        k = keys[r0:r0 + step_r]
        t = None if temps is None else temps[r0:r0 + step_r].to(device=x.device, dtype=torch.float32)[:, None]
        best = at = None
        for c0 in range(0, cols, step_c):
            xs = x[sub, c0:c0 + step_c].to(torch.float32)
            s = race_scores(xs if t is None else xs / t, k, c0)  # x / 1 is x: no division without temps
            m, i = s.max(dim=-1)  # first index of the maximum, NaN first
            i = i + c0
            if best is None:
                best, at = m, i
            else:  # a later chunk wins only strictly, or with a NaN where the earlier had none
                take = (m > best) | (m.isnan() & ~best.isnan())
                best, at = torch.where(take, m, best), torch.where(take, i, at)
        out[r0:r0 + step_r] = at
    return out


def row_kernel(x: torch.Tensor) -> object | None:
    """The C++ kernels (csrc/ops.cpp) where they read `x` in place, the way the row-listing ones take it (CPU,
    contiguous float32 or bf16), else None: the caller's torch path."""
    kern = cpu_ops.kernel() if x.device.type == "cpu" else None
    ok = kern is not None and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous()
    return kern if ok else None


def kernel_rows(x: torch.Tensor, rows: torch.Tensor | None,
                temps: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (rows, temps) arguments of the row-listing kernels (race_rows, top_candidates, row_lse): every row
    of x for None, a temperature of 1 (x / 1 is x) for None."""
    n = x.shape[0] if rows is None else len(rows)
    r = torch.arange(n, dtype=torch.int64) if rows is None else rows.to(torch.int64).contiguous()
    t = torch.ones(n, dtype=torch.float32) if temps is None else temps.to(torch.float32).contiguous()
    return r, t


def scaled_rows(x: torch.Tensor, rows: torch.Tensor | None, temps: torch.Tensor | None) -> torch.Tensor:
    """x[rows] / temps in float32 (all rows: None; no division: None), what the kernels read in place: the torch
    paths' copy (the division the kernels make, so the same values)."""
    y = (x if rows is None else x[rows]).to(torch.float32)
    return y if temps is None else y / temps.to(device=y.device, dtype=torch.float32).unsqueeze(1)


def key_tensor(keys: list[int]) -> torch.Tensor:
    """int64 [R] of uint64 race keys (seeds.draw_key's), the same bits."""
    return torch.tensor([signed64(k) for k in keys], dtype=torch.int64)


def race(x: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor | None = None,
         temps: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R] tokens of the listed `rows` of logits `x` [N, V] (float32 or bf16; all rows: None), each divided
    by its temperature `temps` [R] (None: already divided), keyed by `keys` [R] (int64): csrc/race.cpp on CPU
    where built, else `race_reference` (the same bits)."""
    kern = row_kernel(x)
    if kern is not None:
        return kern.race_rows(x, *kernel_rows(x, rows, temps), keys.to(torch.int64).contiguous())
    return race_reference(x, keys, rows, temps)


def perturb_(x: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, col0: int = 0) -> torch.Tensor:
    """In place on float32 `x` [R, V]: x / t - ln q, each row with its temperature and key, its columns hashed
    as col0, col0 + 1, ... (the race's scores, i.e. Gumbel-max's perturbed logits: their argmax is the race's
    token). csrc/race.cpp on CPU where built, else race_scores (the same bits). Returns x."""
    kern = cpu_ops.kernel() if x.device.type == "cpu" else None
    t = temps.to(device=x.device, dtype=torch.float32).contiguous()
    if kern is not None and x.dtype == torch.float32 and x.is_contiguous():
        kern.race_perturb_(x, t, keys.to(torch.int64).contiguous(), col0)
        return x
    step = max(1, REFERENCE_ELEMENTS // max(1, x.shape[1]))
    for r0 in range(0, x.shape[0], step):
        part = x[r0:r0 + step]
        part.copy_(race_scores(part / t[r0:r0 + step, None], keys[r0:r0 + step], col0))
    return x


def signed64(key: int) -> int:
    """A uint64 key as the int64 with the same bits (torch has no uint64 arithmetic)."""
    key &= (1 << 64) - 1
    return key - (1 << 64) if key >= 1 << 63 else key


__all__ = ["key_tensor", "kernel_rows", "perturb_", "race", "race_reference", "race_scores", "row_kernel",
           "scaled_rows", "signed64"]
