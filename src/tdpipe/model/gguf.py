"""Turn a llama.cpp GGUF file into a Hugging Face style config + float tensors.

tdpipe's model code only knows HF parameter names and HF's rotate_half rope
layout, so everything GGUF-specific (names, quantisation, llama.cpp's rope row
order) is undone here, once, at conversion time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

# GGUF architecture -> (HF architectures entry, HF model_type, undo q/k rope permutation?)
# llama.cpp permutes attn_q/attn_k rows only for Llama-family converters; Qwen2 is stored as-is.
_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


GGUF_MAGIC = b"GGUF"


def open_gguf(gguf_path: str | Path) -> GGUFReader:
    """A GGUFReader over a file checked to be whole: a missing, foreign, truncated or corrupt file is a
    ModelFileError naming the file (the reader's own errors, e.g. "cannot reshape array of size 375744",
    say neither which file nor what is wrong)."""
    from tdpipe.model.weights import MissingModelFile, ModelFileError, human_size

    path = Path(gguf_path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise MissingModelFile(f"GGUF file not found: {path}") from None
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - numpy/struct errors from a short or scrambled file
        msg = " ".join(str(e).split()) or type(e).__name__
        raise ModelFileError(f"{path}: truncated or corrupt GGUF file ({human_size(size)}; the reader "
                             f"failed with: {msg})") from None
    need = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if need > size:
        raise ModelFileError(f"{path}: truncated: header says {human_size(need)} of data, file has "
                             f"{human_size(size)}")
    return reader


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to the HF parameter name tdpipe's model uses."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp rotates interleaved pairs (x0,x1),(x2,x3)..., so its converter
    reorders each head's rows from HF's half-split order [first half | second
    half] into pairs. Reading rows per head as (pair, 2) and transposing to
    (2, pair) restores HF's rotate_half order. Works for weights and biases.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _config(reader: GGUFReader) -> tuple[dict, bool]:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; tdpipe converts {sorted(_ARCHS)}")
    hf_arch, model_type, permute = _ARCHS[arch]
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"GGUF {arch!r} model uses rope_freqs (llama3-style rope scaling); not supported")

    def key(k: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{k}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks required metadata {arch}.{k}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head dim {head_dim}) is not supported")
    eps = np.float32(key("attention.layer_norm_rms_epsilon"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:  # older files: count the embedding rows (GGUF shape is reversed)
        vocab = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
    cfg = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        # stored as float32 in the file: round so 1e-5 is not written as 9.99999974e-06
        "rms_norm_eps": float(np.format_float_positional(eps)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    return cfg, permute


def _tensors(reader: GGUFReader, cfg: dict, permute: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantise lazily, one tensor at a time, so peak memory stays one tensor."""
    q_heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for t in reader.tensors:
        name = hf_name(t.name)
        try:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (ValueError, NotImplementedError) as e:  # a scrambled type or a short data block
            raise ValueError(f"GGUF tensor {t.name!r} (type {t.tensor_type!r}) cannot be dequantised: "
                             f"{' '.join(str(e).split())}") from None
        # numpy dims are already HF's (out_features, in_features); GGUF's `shape` is reversed.
        w = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
        if permute and ".q_proj." in name:
            w = unpermute_rope_rows(w, q_heads)
        elif permute and ".k_proj." in name:
            w = unpermute_rope_rows(w, kv_heads)
        yield name, w.contiguous()


def gguf_to_hf(gguf_path: str | Path) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """Return an HF config dict and a lazy iterator of float32 tensors under HF names."""
    reader = open_gguf(gguf_path)
    cfg, permute = _config(reader)
    return cfg, _tensors(reader, cfg, permute)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_tokenizer(gguf_path: Path, out: Path, cfg: dict) -> None:
    """Let transformers rebuild the fast tokenizer from the GGUF vocab, then pin eos/bos."""
    from transformers import AutoTokenizer  # heavy import, only needed here

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # Chat models stop on the GGUF eos (e.g. <|im_end|>); make the saved tokenizer agree.
    for attr in ("bos", "eos"):
        tid = cfg.get(f"{attr}_token_id")
        if tid is not None:
            setattr(tok, f"{attr}_token", tok.convert_ids_to_tokens(tid))
    tok.save_pretrained(str(out))
    if not tok.chat_template:
        return
    # Older/newer transformers store the template in different places; make sure one exists.
    if not (out / "chat_template.jinja").exists():
        tc_path = out / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text(encoding="utf-8"))
        tc.setdefault("chat_template", tok.chat_template)
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False), encoding="utf-8")


def _provenance(gguf_path: Path, reader_license: str | None, extra: dict[str, str] | None) -> str:
    lines = {
        "source_file": gguf_path.name,
        "license": reader_license or "unknown",
        **(extra or {}),
        "gguf_sha256": sha256_file(gguf_path),
        "converted_by": "tdpipe.model.gguf.convert_gguf_to_hf_folder",
        "note": "weights dequantised from GGUF; q/k rows un-permuted to HF rope layout",
    }
    return "".join(f"{k}: {v}\n" for k, v in lines.items())


def convert_gguf_to_hf_folder(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    provenance: dict[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a self-contained HF model folder converted from ``gguf_path``.

    Everything is written to a temporary sibling and moved into place with one
    ``os.replace``, so readers never see a half-written folder and a process that
    loses a conversion race just discards its copy. An existing folder is kept
    unless ``overwrite``.
    """
    gguf_path, out = Path(gguf_path), Path(out_dir)
    if out.is_dir() and (out / "config.json").is_file() and not overwrite:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        reader = open_gguf(gguf_path)
        try:
            cfg, permute = _config(reader)
            tensors = {name: w.to(dtype) for name, w in _tensors(reader, cfg, permute)}
        except ValueError as e:  # name the file: the conversion usually runs behind --model or the bundle
            from tdpipe.model.weights import ModelFileError

            raise ModelFileError(f"{gguf_path}: {e}") from None
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": [cfg["eos_token_id"]]}
        gen = {k: v for k, v in gen.items() if v not in (None, [None])}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
        _write_tokenizer(gguf_path, tmp, cfg)
        license_ = _field(reader, "general.license")
        (tmp / "PROVENANCE.txt").write_text(_provenance(gguf_path, license_, provenance), encoding="utf-8")
        _move_into_place(tmp, out, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once moved
    return out


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    # mkdtemp and safetensors create owner-only modes; a shared cache should be readable.
    tmp.chmod(0o755)
    for f in tmp.iterdir():
        f.chmod(0o644)
    if overwrite and out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / out.name)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(tmp, out)  # atomic; succeeds onto a missing or empty directory
    except OSError:
        if not (out / "config.json").is_file():
            raise
        # another process finished first; its folder is equally good
