"""Shared fixtures: the bundled model (converted once into a session cache) and HF oracles."""
import os

import pytest


@pytest.fixture(scope="session")
def bundled_path() -> str:
    from tdpipe.model.bundled import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def llm_fp32():
    from tdpipe import LLM

    return LLM(dtype="float32", kv_cache_memory=256 << 20)


@pytest.fixture(scope="session")
def hf_fp32(bundled_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_path, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Transformers' greedy continuation of one unpadded prompt: the correctness oracle."""
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return g[0, ids.shape[1]:].tolist()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
