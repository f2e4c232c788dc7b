"""AWQ checkpoint folders (`--quantization awq`): AutoAWQ's GEMM format, its 4-bit weights kept packed and run
by the GGUF path's block GEMM against int8 activations (W4A8), as vLLM's CPU backend runs AWQ.

An AWQ folder stores each decoder linear [N, K] (out, in) as three tensors (config.json's
`quantization_config`: quant_method "awq", bits 4, version "gemm", zero_point true, group_size G):

    qweight  int32 [K, N / 8]   eight 4-bit q per int32; nibble i holds column 8c + AWQ_ORDER[i]
    qzeros   int32 [K / G, N / 8] the zero points z, packed the same way
    scales   fp16  [K / G, N]   the scales d
    W[n, k] = (q[k, n] - z[k // G, n]) * d[k // G, n]

which is the block layout model/block_linear.py runs, w = s q + m per block of 32 along K, with s = d and
m = -z d for each of a group's G / 32 blocks (exact in float32: d is fp16 and z < 16). So the folder's
integers are used as stored, and nothing is re-quantised.

Loading is the GGUF path's: the stage first loads the folder with every linear dequantised (read_checkpoint,
which is also what `--quantization none`, `w8a8` and float32 runs of an AWQ folder read), then
keep_awq_blocks replaces the decoder linears by the folder's packed blocks, cut for a tensor-parallel rank
and fused (q|k|v, gate|up) as the float ones are. The embedding and lm_head stay as stored (AWQ leaves them
in fp16), like any linear the config names in `modules_to_not_convert`.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tdpipe.model.block_linear import BlockLinear, gemm_path, replace_decoder_linears, shard_blocks
from tdpipe.model.gguf_blocks import BLOCK
from tdpipe.model.weights import ModelFileError, Slicer, check_weights, iter_safetensors

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 holds column 8c + AWQ_ORDER[i]
PACK = 8  # 4-bit values per int32
PARTS = ("qweight", "qzeros", "scales")
# the model's linears -> the checkpoint's, stored apart (Llama, Qwen, Gemma) or fused (Phi-3)
LINEARS = {"self_attn.qkv_proj": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                  ("self_attn.qkv_proj",)),
           "self_attn.o_proj": (("self_attn.o_proj",),),
           "mlp.gate_up_proj": (("mlp.gate_proj", "mlp.up_proj"), ("mlp.gate_up_proj",)),
           "mlp.down_proj": (("mlp.down_proj",),)}


@dataclass(frozen=True)
class AwqSpec:
    """What config.json's quantization_config says, checked: 4 bits, GEMM packing, zero points."""

    group_size: int  # G, a multiple of 32; -1 in the file (one group per row) is kept as -1
    not_converted: tuple[str, ...] = ()

    def group(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size


def awq_spec(folder: str | None) -> AwqSpec | None:
    """The AWQ settings of a model folder (None: not an AWQ checkpoint); an error naming the field for a
    variant tdpipe does not run."""
    if not folder or not (Path(folder) / "config.json").is_file():
        return None
    folder = str(Path(folder).resolve())
    with open(Path(folder) / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    qc = cfg.get("quantization_config") or cfg.get("text_config", {}).get("quantization_config")
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "awq":
        return None

    def bad(field: str, value: Any, want: str) -> ModelFileError:
        return ModelFileError(f"{folder}/config.json: quantization_config.{field} is {value!r}; tdpipe runs AWQ "
                              f"checkpoints with {want}")

    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise bad("bits", bits, "4-bit weights")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise bad("version", qc.get("version"), "the GEMM packing ('gemm')")
    if qc.get("zero_point", True) is not True:
        raise bad("zero_point", qc.get("zero_point"), "zero points (zero_point: true)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or (group > 0 and group % BLOCK == 0)):
        raise bad("group_size", group, f"groups of a multiple of {BLOCK} columns (or -1)")
    return AwqSpec(group, tuple(qc.get("modules_to_not_convert") or ()))


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, 8 C] from AWQ's int32 [R, C] (AWQ_ORDER undone)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = ((packed.to(torch.int32)[..., None] >> shifts) & 0xF).to(torch.uint8)  # [R, C, 8] in nibble order
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib
    return out.reshape(packed.shape[0], -1)


def pack(q: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, C / 8] from 4-bit values [R, C] (what AutoAWQ writes; the tests' checkpoints)."""
    v = q.to(torch.int64).reshape(q.shape[0], -1, PACK)[..., list(AWQ_ORDER)]
    word = (v << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def check_shapes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, spec: AwqSpec) -> None:
    """The three tensors agree with each other and with group_size (a clear error, not a shape mismatch
    deep in the GEMM's packing)."""
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    g = spec.group(k)
    groups = k // g if k % g == 0 else -1
    if (qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or k % BLOCK or groups < 0
            or tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, -(-n // PACK))):
        raise ModelFileError(f"AWQ tensors qweight {tuple(qweight.shape)} {qweight.dtype}, qzeros "
                             f"{tuple(qzeros.shape)} {qzeros.dtype}, scales {tuple(scales.shape)} do not fit "
                             f"group_size {spec.group_size} (want int32 [K, N/8], int32 [K/G, N/8], [K/G, N], "
                             f"K a multiple of G and of {BLOCK})")


def awq_blocks(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               spec: AwqSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], s, m float32 [N, K / 32]) of one linear: the block form w = s q + m."""
    check_shapes(qweight, qzeros, scales, spec)
    q = unpack(qweight).t().contiguous()
    k = q.shape[1]
    per = spec.group(k) // BLOCK  # blocks per group
    d = scales.float()
    z = unpack(qzeros)[:, :d.shape[1]].float()
    s = d.t().repeat_interleave(per, dim=1).contiguous()
    m = (-z * d).t().repeat_interleave(per, dim=1).contiguous()
    return q, s, m


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, spec: AwqSpec) -> torch.Tensor:
    """The float32 weight [N, K]: (q - z) d, AutoAWQ's own dequantisation."""
    check_shapes(qweight, qzeros, scales, spec)
    q = unpack(qweight).float()
    g = spec.group(q.shape[0])
    z = unpack(qzeros)[:, :scales.shape[1]].float().repeat_interleave(g, dim=0)
    return ((q - z) * scales.float().repeat_interleave(g, dim=0)).t().contiguous()


def read_checkpoint(folder: str, names: Callable[[str], bool] | None = None,
                    slicer: Slicer | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_safetensors for any folder, an AWQ one's linears dequantised to `PREFIX.weight` (this rank's rows
    or columns of it, as slicer says of that name)."""
    spec = awq_spec(folder)
    if spec is None:
        yield from iter_safetensors(folder, names, slicer)
        return
    whole: Slicer = lambda n: None if n.rpartition(".")[2] in PARTS else (slicer(n) if slicer else None)  # noqa: E731
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in iter_safetensors(folder, names, whole):
        prefix, _, leaf = name.rpartition(".")
        if leaf not in PARTS:
            yield name, t
            continue
        got = pending.setdefault(prefix, {})
        got[leaf] = t
        if len(got) == len(PARTS):
            del pending[prefix]
            w = dequantize(got["qweight"], got["qzeros"], got["scales"], spec)
            part = slicer(prefix + ".weight") if slicer else None
            if part is not None:
                dim, a, b = part
                w = (w[a:b] if dim == 0 else w[:, a:b]).contiguous()
            yield prefix + ".weight", w
    if pending:
        raise ModelFileError(f"{folder}: AWQ linears without all of {', '.join(PARTS)}: {sorted(pending)[:3]}")


def _tensor_files(folder: str) -> dict[str, Path]:
    """checkpoint tensor name -> the safetensors file holding it (read at each load: update_weights may
    rewrite a folder in place)."""
    where = {}
    for shard in check_weights(folder):
        with safe_open(str(shard), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), shard))
    return where


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def _linear_from(files: dict[str, Path], spec: AwqSpec, model: Any, layer: int, parts: tuple[str, ...],
                 bias: torch.Tensor | None) -> BlockLinear | None:
    """One of the slice's linears from the checkpoint's parts, or None where a part is not AWQ-packed."""
    prefixes = [f"model.layers.{layer}.{p}" for p in parts]
    if not all(p + ".qweight" in files for p in prefixes):
        return None
    got = []
    for part, prefix in zip(parts, prefixes):
        q, s, m = awq_blocks(*(_read(files, f"{prefix}.{leaf}") for leaf in PARTS), spec)
        proj = part.rsplit(".", 1)[1]
        if proj in ("qkv_proj", "gate_up_proj"):  # stored fused: this rank's rows of each piece
            q, s, m = (model._rank_rows(proj, t) for t in (q, s, m))
        else:
            q, s, m = shard_blocks(model, prefix + ".weight", q, s, m)
        got.append((q, s, m))
    q, s, m = (torch.cat([g[i] for g in got]).contiguous() for i in range(3))
    return BlockLinear(q, s, m, 4, bias)


def keep_awq_blocks(model: nn.Module, folder: str) -> int:
    """Replace the slice's decoder linears by the folder's packed 4-bit blocks; returns how many were."""
    spec = awq_spec(folder)
    if spec is None:
        raise ValueError(f"quantization 'awq' needs an AWQ checkpoint folder (config.json's quantization_config "
                         f"with quant_method 'awq'), got {folder!r}")
    gemm_path()  # the one-line notice of the code path
    files = _tensor_files(folder)

    def build(idx: int, attr: str, old: nn.Linear) -> BlockLinear | None:
        made = (_linear_from(files, spec, model, idx, parts, old.bias) for parts in LINEARS[attr])
        return next((lin for lin in made if lin is not None), None)  # the first layout the folder has

    return replace_decoder_linears(model, LINEARS, build)


LINEAR_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight")


def quantize_rtn(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, qzeros, scales) of a float weight [N, K] in AWQ's format, each group's min..max over 16
    levels rounded to nearest (AutoAWQ's pseudo-quantiser, without its activation-aware scaling search)."""
    n, k = w.shape
    g = k if group == -1 else group
    if g <= 0 or g % BLOCK or k % g:
        raise ValueError(f"group size {group} must be a multiple of {BLOCK} that divides the input size {k} (or -1)")
    wg = w.float().reshape(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    d = ((hi - lo).clamp(min=1e-5) / 15).half().float()  # stored as fp16: quantise with what is stored
    z = (-torch.round(lo / d)).clamp(0, 15)
    q = (torch.round(wg / d[..., None]) + z[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return pack(q.t().contiguous()), pack(z.to(torch.uint8).t().contiguous()), d.t().contiguous().half()


def write_rtn_checkpoint(folder: str, output: str, group_size: int = 128) -> int:
    """`folder`'s checkpoint in AWQ's format, its decoder linears quantised by quantize_rtn (what the tests
    and `scripts/quant/awq_rtn.py` run where no published AWQ folder is at hand); returns the linears done."""
    import os
    import shutil

    from safetensors.torch import save_file

    os.makedirs(output, exist_ok=True)
    out, n = {}, 0
    for name, t in iter_safetensors(folder):
        if LINEAR_WEIGHT.fullmatch(name):
            prefix = name.removesuffix(".weight")
            out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"], out[f"{prefix}.scales"] = quantize_rtn(t, group_size)
            n += 1
        else:
            out[name] = t.contiguous()
    save_file(out, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm",
                                  "zero_point": True}
    with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    for f in os.listdir(folder):
        if "token" in f or f.endswith(".jinja") or f in ("generation_config.json", "special_tokens_map.json"):
            shutil.copy(os.path.join(folder, f), output)
    return n


__all__ = ["AWQ_ORDER", "AwqSpec", "awq_blocks", "awq_spec", "check_shapes", "dequantize", "keep_awq_blocks", "pack",
           "quantize_rtn", "read_checkpoint", "unpack", "write_rtn_checkpoint"]
