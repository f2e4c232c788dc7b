"""GGUF export (model/gguf_export.py): a random model of each exported family, written in llama.cpp's names,
read back by tdpipe's own GGUF loader, gives the same config shape and the same tensors (bit for bit: bf16
weights). Tiny configs: seconds."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from tdpipe.model.gguf import convert_gguf_to_hf_folder
from tdpipe.model.gguf_export import gguf_name, main, permute_rope_rows, write_gguf
from tdpipe.model.gguf_families import FAMILIES
from tdpipe.model.random_model import random_model_folder

_SHAPE = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
CONFIGS = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
              "tie_word_embeddings": True, **_SHAPE},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 24,
                "tie_word_embeddings": False, **_SHAPE},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "sliding_window": 47,
             "tie_word_embeddings": False, **{**_SHAPE, "num_key_value_heads": 4}},
    # Granite's four multipliers, none of them 1, as llama.cpp's *_scale keys
    "granite": {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "embedding_multiplier": 3.0,
                "attention_multiplier": 0.2, "residual_multiplier": 0.3, "logits_scaling": 4.0,
                "tie_word_embeddings": False, **_SHAPE},
    # Gemma (1): norms stored as 1 + w, Llama's layout otherwise
    "gemma": {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "head_dim": 32,
              "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, **_SHAPE},
    # norms stored as 1 + w, the caps and the window as llama.cpp writes them, a scale it would not derive
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 32, "sliding_window": 24,
               "query_pre_attn_scalar": 24, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, **_SHAPE},
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_export_round_trips_through_tdpipes_gguf_loader(family: str, tmp_path: Path) -> None:
    cfg = CONFIGS[family]
    folder = Path(random_model_folder(cfg, seed=1, root=tmp_path))
    path = write_gguf(folder, tmp_path / f"{family}.gguf")
    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    assert arch == {"mistral": "llama"}.get(family, family)
    assert "blk.0.attn_q.weight" in {t.name for t in r.tensors} or family == "phi3"
    back = convert_gguf_to_hf_folder(path, tmp_path / f"{family}-back", dtype=torch.float32)
    got = json.loads((back / "config.json").read_text())
    assert got["architectures"] == cfg["architectures"]
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert got[k] == cfg[k], k
    assert got.get("sliding_window") == cfg.get("sliding_window")
    for k in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "embedding_multiplier",
              "attention_multiplier", "residual_multiplier", "logits_scaling"):
        assert got.get(k) == cfg.get(k), k
    if family == "gemma2":
        assert got["layer_types"] == ["sliding_attention", "full_attention"]
    if family.startswith("gemma"):
        norm = next(t for t in r.tensors if t.name == "blk.0.attn_norm.weight")
        assert float(norm.data[0]) == 1.0  # random_model's Gemma norms are 0: llama.cpp's 1 + w
    want = load_file(str(folder / "model.safetensors"))
    have = load_file(str(back / "model.safetensors"))
    assert set(have) == set(want)
    for k, t in want.items():
        assert torch.equal(have[k], t.float()), k


def test_llama_biases_round_trip_with_their_rows(tmp_path: Path) -> None:
    """Llama's optional biases (attention_bias: q/k/v/o, mlp_bias: gate/up/down) are written and read back;
    q's and k's are permuted with their weight rows as llama.cpp's converter does (a bias left in HF's order
    would put each value on another rope dimension). Non-zero biases, or the permutation could not show."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True,
           "attention_bias": True, "mlp_bias": True, **_SHAPE}
    folder = Path(random_model_folder(cfg, seed=1, root=tmp_path))
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for k, t in tensors.items():
        if k.endswith(".bias"):
            tensors[k] = torch.randn(t.shape, generator=g).to(t.dtype)
    assert sum(k.endswith(".bias") for k in tensors) == 2 * 7
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    path = write_gguf(folder, tmp_path / "llama.gguf")
    assert "blk.1.attn_output.bias" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    back = convert_gguf_to_hf_folder(path, tmp_path / "llama-back", dtype=torch.float32)
    assert json.loads((back / "config.json").read_text())["mlp_bias"] is True
    have = load_file(str(back / "model.safetensors"))
    assert set(have) == set(tensors)
    for k, t in tensors.items():
        assert torch.equal(have[k], t.float()), k


def test_names_and_permutation_are_llama_cpps() -> None:
    fam = FAMILIES["qwen3"]
    assert gguf_name("model.layers.3.self_attn.k_norm.weight", fam) == "blk.3.attn_k_norm.weight"
    assert gguf_name("model.embed_tokens.weight", fam) == "token_embd.weight"
    assert gguf_name("model.layers.0.mlp.gate_up_proj.weight", FAMILIES["phi3"]) == "blk.0.ffn_up.weight"
    with pytest.raises(ValueError, match="q_norm"):
        gguf_name("model.layers.0.self_attn.q_norm.weight", FAMILIES["llama"])
    # head of 4 rows: HF's halves (0 1 | 2 3) become pairs (0 2 1 3)
    w = torch.arange(8.0).reshape(8, 1)
    assert permute_rope_rows(w, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_cli_refuses_layers_without_random(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--folder", str(tmp_path), "--layers", "2", str(tmp_path / "x.gguf")])
    with pytest.raises(ValueError, match="architectures"):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
        write_gguf(tmp_path, tmp_path / "x.gguf")
