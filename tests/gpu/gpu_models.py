"""Models the GPU tests share: small random Llamas with decisive logits, saved as checkpoint folders beside
their transformers twin on the GPU (the oracle). A plain module, not a conftest.py: a second conftest module
would shadow the helpers of tests/conftest.py."""
import torch

from tdpipe.bench.gpu_check import TINY_LLAMA


def decisive_model(root, seed: int):
    """(folder, transformers model on cuda): a 2-layer Llama whose weights are large enough (std 0.3) that
    greedy argmaxes are never near-ties, saved with the random-model tokenizer; `seed` picks the weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tdpipe.model.random_model import random_model_folder

    folder = random_model_folder({k: v for k, v in TINY_LLAMA.items() if k != "_source"}, root=root)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if not k.startswith("_") and k != "architectures"},
                      initializer_range=0.3)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)  # replaces the random weights; the tokenizer files stay
    return folder, model.to("cuda")

