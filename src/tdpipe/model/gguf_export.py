"""A Hugging Face model folder written as a GGUF file in llama.cpp's tensor names and metadata.

Why: tdpipe is compared with llama.cpp on the *same file* (`tdpipe bench llama-cpp`), but for most families
no published weights are here, and nothing downloads at run time. Throughput depends on shapes, not values,
so the bench draws random weights for a published config (model/random_model.py) and this module writes
them as llama.cpp's converter (convert_hf_to_gguf.py) would: its names, the `{arch}.*` shape keys, the q/k
row permutation of the Llama family, a byte-level BPE vocabulary ("gpt2" tokenizer model). It is the
inverse of model/gguf_families.py's table, so tdpipe's own GGUF loader reading the file back gives the
folder's tensors (tests/unit/test_gguf_export.py). Weights are written as BF16 (or F16 / F32), tensor by
tensor: peak memory is one tensor, not the model.

    python -m tdpipe.model.gguf_export --random qwen3-0.6b qwen3-0.6b-random-bf16.gguf
    python -m tdpipe.model.gguf_export --random mistral-7b-v0.1 --layers 4 mistral-7b-4l-random-bf16.gguf
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tdpipe.model.gguf_families import (FAMILIES, GEMMA2_27B_LAYERS, GLOBAL_NAMES, Family,
                                        derived_query_pre_attn_scalar)

# HF architecture -> what llama.cpp writes in general.architecture (Mistral is written as llama)
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "GemmaForCausalLM": "gemma",
             "Gemma2ForCausalLM": "gemma2", "GraniteForCausalLM": "granite"}
DTYPES = ("bf16", "f16", "f32")  # tensor types written (norms and 1-D tensors always F32, as llama.cpp does)


def _family(cfg: dict[str, Any]) -> tuple[str, Family]:
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in GGUF_ARCH:
        raise ValueError(f"config architectures {arch!r}: GGUF export supports {', '.join(sorted(GGUF_ARCH))}")
    if cfg.get("rope_scaling"):
        raise ValueError("config rope_scaling is set: GGUF export writes unscaled rope only")
    return GGUF_ARCH[arch], FAMILIES["mistral" if arch == "MistralForCausalLM" else GGUF_ARCH[arch]]


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's Llama-family q/k row order: HF's half-split rope rows per head -> interleaved pairs (the
    inverse of gguf.py's unpermute)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_name(hf_name: str, family: Family) -> str:
    """llama.cpp's name of an HF tensor (model.layers.N.self_attn.q_proj.weight -> blk.N.attn_q.weight)."""
    if hf_name in GLOBAL_NAMES.values():
        return next(g for g, h in GLOBAL_NAMES.items() if h == hf_name)
    if not hf_name.startswith("model.layers."):
        raise ValueError(f"tensor {hf_name!r} has no llama.cpp name")
    _, _, layer, rest = hf_name.split(".", 3)
    sub, kind = rest.rsplit(".", 1)
    inverse = {h: g for g, h in family.names.items()}
    if sub not in inverse:
        raise ValueError(f"tensor {hf_name!r}: no llama.cpp name for {sub!r} in {family.hf_arch}")
    return f"blk.{layer}.{inverse[sub]}.{kind}"


def _metadata(w: Any, cfg: dict[str, Any], family: Family, name: str) -> None:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    # llama.cpp fixes up Phi-3's SentencePiece specials (<s>, </s>, <unk>) when general.name says "phi-3" or
    # "phi3", and fails to load a vocabulary without them: ours is byte-level BPE, so keep the name clear of it
    w.add_name(name.lower().replace("phi-3", "phi 3").replace("phi3", "phi 3"))
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(1)  # MOSTLY_F16 (informative only)
    if family.model_type in ("mistral", "phi3") and cfg.get("sliding_window"):
        w.add_sliding_window(int(cfg["sliding_window"]))
    if family.model_type == "gemma2":
        _gemma2_metadata(w, cfg, head_dim)
    if family.model_type == "granite":  # llama.cpp's converter: each multiplier that the config sets
        for key, add in (("attention_multiplier", w.add_attention_scale), ("embedding_multiplier",
                         w.add_embedding_scale), ("residual_multiplier", w.add_residual_scale),
                         ("logits_scaling", w.add_logit_scale)):
            if cfg.get(key):
                add(float(cfg[key]))


def _gemma2_metadata(w: Any, cfg: dict[str, Any], head_dim: int) -> None:
    """What llama.cpp's converter writes for Gemma 2 (the window and both caps), and attention.scale where
    the config's query_pre_attn_scalar is not the one llama.cpp derives (hidden / heads at 46 layers, else
    head_dim): llama.cpp itself would then scale differently, tdpipe's loader reads the key."""
    types = cfg.get("layer_types")
    if types is not None and types != ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(cfg["num_hidden_layers"])]:
        raise ValueError("config layer_types: GGUF export writes Gemma 2's own alternation only (the first "
                         "layer sliding)")
    w.add_sliding_window(int(cfg.get("sliding_window") or 4096))
    for key, add in (("attn_logit_softcapping", w.add_attn_logit_softcapping),
                     ("final_logit_softcapping", w.add_final_logit_softcapping)):
        if cfg.get(key):
            add(float(cfg[key]))
    qpas = cfg.get("query_pre_attn_scalar", 256)
    derived = derived_query_pre_attn_scalar(cfg["num_hidden_layers"], cfg["hidden_size"],
                                            cfg["num_attention_heads"], head_dim, GEMMA2_27B_LAYERS)
    if qpas != derived:
        w.add_attention_scale(float(qpas) ** -0.5)


def _tokenizer(w: Any, folder: Path, cfg: dict[str, Any]) -> None:
    """The folder's byte-level BPE (tokenizer.json) as llama.cpp's "gpt2" tokenizer model."""
    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{folder}/tokenizer.json: GGUF export writes byte-level BPE tokenizers only")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    n = cfg["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(n)]  # llama.cpp's filler for unused ids
    types = [5] * n  # UNUSED
    for t, i in vocab.items():
        if i < n:
            tokens[i], types[i] = t, (3 if t in special else 1)  # CONTROL / NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eos = next(iter(special.values()), None) if special else None
    if eos is not None:
        w.add_eos_token_id(eos)
        w.add_bos_token_id(eos)
        w.add_pad_token_id(eos)
    w.add_add_bos_token(False)
    tc = folder / "tokenizer_config.json"
    template = json.loads(tc.read_text(encoding="utf-8")).get("chat_template") if tc.exists() else None
    if template:
        w.add_chat_template(template)


def write_gguf(folder: str | Path, out: str | Path, dtype: str = "bf16", name: str | None = None) -> Path:
    """Write the HF folder (config.json, *.safetensors, a byte-level BPE tokenizer.json) as a GGUF file."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize
    from safetensors import safe_open

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    arch, family = _family(cfg)
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files")
    qtype = {"bf16": Q.BF16, "f16": Q.F16, "f32": Q.F32}[dtype]
    w = GGUFWriter(str(out), arch)
    _metadata(w, cfg, family, name or folder.name)
    _tokenizer(w, folder, cfg)
    plan: list[tuple[Path, str, str, Any]] = []  # (file, hf name, gguf name, type)
    for f in files:
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                if key == "lm_head.weight" and cfg.get("tie_word_embeddings"):
                    continue
                shape = st.get_slice(key).get_shape()
                t = Q.F32 if len(shape) == 1 else qtype
                g = gguf_name(key, family)
                probe = quantize(np.zeros((1, shape[-1]), np.float32), t)
                row_bytes = probe.nbytes
                n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
                byte_shape = (*shape[:-1], row_bytes) if t is not Q.F32 else tuple(shape)
                np_dtype = np.uint8 if t is not Q.F32 else np.float32
                w.add_tensor_info(g, byte_shape, np.dtype(np_dtype), row_bytes * n_rows, raw_dtype=t)
                plan.append((f, key, g, t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for f, key, g, t in plan:
        with safe_open(str(f), "pt") as st:
            x = st.get_tensor(key).float()
        if family.norm_offset and key.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + w
            x = x + family.norm_offset
        if family.permute_qk and g.endswith((".attn_q.weight", ".attn_q.bias")):  # biases turn with their rows
            x = permute_rope_rows(x, heads)
        elif family.permute_qk and g.endswith((".attn_k.weight", ".attn_k.bias")):
            x = permute_rope_rows(x, kv)
        arr = x.numpy()
        w.write_tensor_data(arr if t is Q.F32 else quantize(arr, t))
    w.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tdpipe.model.gguf_export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--folder", help="an HF model folder (safetensors, byte-level BPE tokenizer.json)")
    src.add_argument("--random", metavar="NAME", help="random weights of a shipped published config "
                     "(model/configs/NAME.json; generated once into the tdpipe cache)")
    p.add_argument("--layers", type=int, default=None,
                   help="with --random: keep only the first N decoder layers of the config (real shapes, fewer "
                        "layers, for a machine too small for the whole model)")
    p.add_argument("--seed", type=int, default=0, help="with --random: the weights' seed")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="tensor type of the 2-D weights")
    p.add_argument("out", help="the GGUF file to write")
    a = p.parse_args(argv)
    if a.layers is not None and a.random is None:
        p.error("--layers needs --random")
    if a.random is not None:
        from tdpipe.model.random_model import published_config, random_model_folder

        cfg = published_config(a.random)
        name = a.random
        if a.layers is not None:
            if not 1 <= a.layers <= cfg["num_hidden_layers"]:
                p.error(f"--layers {a.layers}: the config has {cfg['num_hidden_layers']} layers")
            cfg = {**cfg, "num_hidden_layers": a.layers,
                   "_source": f"{cfg.get('_source', a.random)}, first {a.layers} layers"}
            name = f"{a.random}-{a.layers}layers"
        folder = random_model_folder(cfg if a.layers is not None else a.random, seed=a.seed)
    else:
        folder, name = a.folder, None
    path = write_gguf(folder, a.out, a.dtype, name=f"{name} random" if name else None)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) from {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
