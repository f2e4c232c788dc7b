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



TINY_GEMMA2 = {k: v for k, v in TINY_LLAMA.items() if not k.startswith("_")} | {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "query_pre_attn_scalar": 16,
    "sliding_window": 8, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 30.0,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}


def gemma2_model(root, seed: int):
    """(folder, transformers model on cuda): a 2-layer Gemma 2 (the first layer slides over 8 tokens, scores
    capped at 2, so the cap bends them), weights moved away from their init by std 0.3, eager attention in
    transformers (its soft-capping path)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tdpipe.model.random_model import random_model_folder

    folder = random_model_folder(TINY_GEMMA2, root=root)
    torch.manual_seed(seed)
    cfg = Gemma2Config(**{k: v for k, v in TINY_GEMMA2.items() if k not in ("architectures", "model_type")},
                       attn_implementation="eager")
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return folder, model.to("cuda")
