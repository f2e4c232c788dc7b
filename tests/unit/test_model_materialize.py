"""The model runner gives a meta-built model its storage in the run's dtype, so the checkpoint's tensors
are converted once, as they are copied in: a bf16 model is never held in float32 on the way (its start-up
peak was the float32 model, twice the bf16 one). What the weights become is unchanged, bit for bit."""
from __future__ import annotations

import dataclasses

import torch

from tdpipe.config import ModelConfig
from tdpipe.model.llama import LlamaForCausalLM
from tdpipe.core.engine_builder import random_weights
from tdpipe.worker.model_runner import _materialize

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "eos_token_id": 0}


def _gemma_norms(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, norm="gemma")


def test_parameters_are_made_in_the_runs_dtype_and_hold_the_same_bits_as_a_float32_detour():
    cfg = ModelConfig.from_hf(LLAMA)
    weights = list(random_weights(LLAMA, seed=5))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, 0, None)
    _materialize(model, torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model.load_weights(iter(weights))
    direct = model.to(torch.bfloat16).state_dict()
    with torch.device("meta"):
        old = LlamaForCausalLM(cfg, 0, None)
    _materialize(old, torch.device("cpu"))  # the declared dtypes (float32), then a cast: the old way
    old.load_weights(iter(weights))
    detour = old.to(torch.bfloat16).state_dict()
    assert direct.keys() == detour.keys()
    for k in direct:
        assert direct[k].dtype == detour[k].dtype and torch.equal(direct[k], detour[k]), k


def test_gemma_norm_weights_are_made_in_float32_and_stay_so():
    cfg = _gemma_norms(ModelConfig.from_hf(LLAMA))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, 0, None)
    _materialize(model, torch.device("cpu"), torch.bfloat16)
    norms = {n for n, m in model.named_modules() if type(m).__name__ == "GemmaRMSNorm"}
    assert norms
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        assert p.dtype == (torch.float32 if owner in norms else torch.bfloat16), name
    model.load_weights(iter(random_weights(LLAMA, seed=5)))
    model = model.to(torch.bfloat16)
    assert all(m.weight.dtype == torch.float32 for n, m in model.named_modules() if n in norms)
