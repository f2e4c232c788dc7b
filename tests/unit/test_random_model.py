"""Random-weight models of published configs (`--model random:NAME`): the shipped configs have the published
sizes, a generated folder loads in the real engine (bf16, finite outputs), is cached and reused, and an
unknown name fails listing the known ones."""
import os

import pytest

from tdpipe.config import ModelConfig
from tdpipe.model import random_model as rm

TINY = {"_source": "test", "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 500,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "eos_token_id": 7}
TINY_LLAMA = {**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 70000,
              "eos_token_id": 69999, "head_dim": 16}


def _params(cfg: dict) -> int:
    import torch

    return sum(torch.Size(s).numel() for _, s, _ in rm.tensor_shapes(cfg))


def test_shipped_configs_have_the_published_sizes():
    assert {"qwen2.5-0.5b", "llama-3.2-1b"} <= set(rm.known_configs())
    q = rm.published_config("qwen2.5-0.5b")
    mc = ModelConfig.from_hf(q)
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.vocab_size) == (896, 24, 14, 2, 151936)
    assert mc.qkv_bias and mc.tie_word_embeddings
    assert abs(_params(q) - 494.0e6) < 1.5e6  # Qwen2.5-0.5B: 0.49B parameters
    assert abs(_params(rm.published_config("llama-3.2-1b")) - 1.236e9) < 0.01e9  # Llama 3.2 1B: 1.24B


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown random model 'gpt-5'.*qwen2.5-0.5b"):
        rm.published_config("gpt-5")
    from tdpipe.model.bundled import resolve_model

    with pytest.raises(ValueError, match="unknown random model 'nope'"):
        resolve_model("random:nope")


@pytest.mark.slow
def test_generated_folder_runs_in_the_engine_and_is_reused(tmp_path):
    folder = rm.random_model_folder(TINY, seed=3, root=tmp_path)
    files = set(os.listdir(folder))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    mtime = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
    assert rm.random_model_folder(TINY, seed=3, root=tmp_path) == folder  # cached: not generated again
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == mtime
    assert rm.random_model_folder(TINY, seed=4, root=tmp_path) != folder

    from tdpipe import LLM, SamplingParams

    with LLM(folder, dtype="bfloat16", kv_cache_memory=16 << 20) as llm:
        outs = llm.generate(["Hello, world!", {"prompt_token_ids": [1, 2, 3]}],
                            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1),
                            use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 6 and all(0 <= t < 500 for t in c.token_ids)
        assert all(abs(lp[t].logprob) < 1e9 for lp, t in zip(c.logprobs, c.token_ids))  # finite
    from tdpipe.tokenizer import load_tokenizer

    assert outs[0].prompt_token_ids == load_tokenizer(folder).encode("Hello, world!") != []


def test_weights_and_tokenizer_match_the_config(tmp_path, monkeypatch):
    """Oracle: the streamed safetensors against safetensors' own reader and the same draws made in memory."""
    import torch
    from safetensors import safe_open
    from tokenizers import Tokenizer

    monkeypatch.setenv("TDPIPE_CACHE", str(tmp_path))
    folder = rm.random_model_folder(TINY, seed=1)
    shapes = rm.tensor_shapes(TINY)
    g = torch.Generator().manual_seed(1)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(n for n, _, _ in shapes)
        for name, shape, init in shapes:
            t = f.get_tensor(name)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == shape
            if init == "normal":
                want = torch.empty(shape).normal_(0.0, 0.02, generator=g).to(torch.bfloat16)
                assert torch.equal(t, want), name
            else:
                assert torch.equal(t, torch.full(shape, 1.0 if init == "ones" else 0.0, dtype=torch.bfloat16)), name
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    assert tok.get_vocab_size() == TINY["vocab_size"]
    assert sorted(tok.get_vocab().values()) == list(range(TINY["vocab_size"]))


@pytest.mark.parametrize("cfg", [TINY, TINY_LLAMA], ids=["qwen2", "llama"])
def test_transformers_tokenizer_round_trips_over_the_whole_vocabulary(cfg, tmp_path, monkeypatch):
    """transformers picks the tokenizer class by model_type (qwen2: rebuilt as byte-level BPE from the vocab
    and merges): whichever it picks must cover exactly the config's ids, end with the config's eos id, and
    decode what it encodes (byte-level: lossless)."""
    from tdpipe.tokenizer import load_tokenizer

    monkeypatch.setenv("TDPIPE_CACHE", str(tmp_path))
    tok = load_tokenizer(rm.random_model_folder(cfg))
    assert len(tok) == cfg["vocab_size"] and tok.eos_token_id == cfg["eos_token_id"]
    text = "Random weights, déjà vu 123 — \u4f60\u597d\n\ttabs"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids and all(0 <= i < cfg["vocab_size"] for i in ids) and tok.decode(ids) == text
    if cfg["vocab_size"] > 256 + 256 ** 2:  # every byte pair is a token: the merges apply
        assert len(ids) < len(text.encode())
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "user: hi\nassistant: "


def test_preflight_accepts_known_random_models_and_names_unknown_ones():
    """`tdpipe bench throughput --model random:qwen2.5-0.5b` used to be refused as a missing file."""
    from tdpipe.entrypoints.preflight import PreflightError, check_model

    check_model("random:qwen2.5-0.5b")
    with pytest.raises(PreflightError, match="random:nope: unknown random model; known: random:gemma-2-2b, "
                                             "random:gemma-3-270m, random:llama"):
        check_model("random:nope")
    with pytest.raises(PreflightError, match="--model /no/such: no such file or directory"):
        check_model("/no/such")


def test_weights_drawn_on_a_gpu_get_a_folder_of_their_own(tmp_path, monkeypatch):
    """A GPU's generator draws other values than the CPU's: such weights are cached under their own name
    (and manifest), while an explicit device="cpu" is the folder every earlier run made."""
    monkeypatch.setenv("TDPIPE_CACHE", str(tmp_path))
    cpu = rm.random_model_folder(TINY, seed=1, device="cpu")
    assert cpu == rm.random_model_folder(TINY, seed=1)
    drawn, generate = [], rm._generate

    def on_the_cpu(folder, cfg, seed, what, device):  # no GPU here: the same files, drawn on the CPU
        drawn.append(device)
        generate(folder, cfg, seed, what, "cpu")

    monkeypatch.setattr(rm, "_generate", on_the_cpu)
    gpu = rm.random_model_folder(TINY, seed=1, device="cuda")
    assert gpu == cpu + "-cuda" and drawn == ["cuda"]
    assert rm.random_model_folder(TINY, seed=1, device="cuda") == gpu and drawn == ["cuda"]  # cached
    assert rm.random_model_folder(TINY, seed=1) == cpu and drawn == ["cuda"]
