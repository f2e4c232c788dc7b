"""The decoder of every supported family over a paged KV cache: Llama 2/3 (SmolLM2), Mistral, Qwen2 (q/k/v
bias), Qwen3 (q/k norms), Gemma 3 text (Gemma norms around attention and MLP, GeGLU, scaled embeddings,
local and global layers with their own rope) and Phi-3 (fused checkpoint tensors, longrope, partial rope).
One model class reads the family's differences from ModelConfig (tdpipe/families.py fills them): the parts a
family lacks are never built, so Llama and Qwen2 run the ops they always ran.

A model object holds a contiguous slice of layers [start_layer, end_layer): the embedding lives on the
first slice, the final norm and lm_head on the last, so a pipeline stage is just a slice (pp = 1 holds all).
q/k/v and gate/up projections are fused into one matmul each on load (fewer, larger GEMMs).
With a tensor-parallel group (tp, model/tensor_parallel.py) the slice holds this rank's Megatron shard:
its heads, MLP rows and vocabulary range, read from the checkpoint alone (safetensors slices).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tdpipe.config import ModelConfig
from tdpipe.model import paged_attention as pa
from tdpipe.model import cpu_ops as ops
from tdpipe.model.layers import RotaryEmbedding, make_norm
from tdpipe.model.weights import canonical_name
from tdpipe.model.tensor_parallel import SINGLE, TPGroup, greedy_ids, head_split, shard_range


@dataclass
class AttentionMetadata:
    """Tensors every layer's attention reads; built once per micro-batch by the stage's input preparation."""

    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    cu_seqlens_q: torch.Tensor  # int32 [S+1]
    seq_lens: torch.Tensor  # int32 [S]
    fresh: bool  # no cached prefix anywhere: attend over the new tokens only
    cu_seqlens_list: list[int]
    # the sliding-window layers' own view when they keep their KV in a pool of their own (core/window_blocks.py):
    # its slot_mapping and block_tables index that pool; None: windowed layers read the fields above
    local: "AttentionMetadata | None" = None


class Attention(nn.Module):
    """q/k/v column-parallel (this rank's heads), o_proj row-parallel + one all-reduce. `window`: this
    layer's sliding window (None: global); q/k norms over head_dim before rope where the family has them."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE, window: int | None = None) -> None:
        super().__init__()
        heads = head_split(cfg.num_heads, cfg.num_kv_heads, tp.size)[tp.rank]
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_count, heads.kv_count, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.softcap = cfg.attn_softcap or 0.0  # Gemma 2's attn_logit_softcapping
        self.window = window
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg.norm, cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = make_norm(cfg.norm, cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary(q, meta.positions)
        k = rotary(k, meta.positions)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        pa.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        w = self.window
        if meta.fresh and not pa.kernel_prefill(q, k_cache):
            o = pa.prefill_attention(q, k, v, meta.cu_seqlens_list, self.scale, w, self.softcap)
        else:
            o = pa.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
                                   self.scale, w, self.softcap)
        return self.tp.all_reduce_(self.o_proj(o.reshape(t, self.q_size)))


class MLP(nn.Module):
    """gate/up column-parallel (this rank's rows of the intermediate size), down row-parallel + one all-reduce.
    SwiGLU, or GeGLU (gelu_pytorch_tanh: Gemma)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        a, b = shard_range(cfg.intermediate_size, tp.size, tp.rank)
        self.tp = tp
        self.inter = b - a
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ops.gelu_tanh_and_mul if cfg.hidden_act == "gelu_pytorch_tanh" else ops.silu_and_mul
        self.fused: Callable[[torch.Tensor], torch.Tensor] | None = None  # W8A8's one-pass SwiGLU (int8_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.tp.all_reduce_(self.fused(x))
        return self.tp.all_reduce_(self.down_proj(self.act(self.gate_up_proj(x))))


class VocabParallelEmbedding(nn.Module):
    """The rows of this rank's vocabulary range; other ids look up zeros, and the all-reduce fills them in."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.end = shard_range(vocab, tp.size, tp.rank)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        x = nn.functional.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        x.masked_fill_(~mine[:, None], 0)
        return self.tp.all_reduce_(x)


class DecoderLayer(nn.Module):
    """Pre-norm layer (Llama): x + attn(norm(x)), then + mlp(norm(.)), the residual adds fused into the norms."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp, window)
        self.post_attention_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)
        self.residual_scale = cfg.residual_scale  # Granite's residual_multiplier; 1 elsewhere

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryEmbedding,
                meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); their sum is the layer output."""
        h, residual = self._input_norm(x, residual)
        h = self.self_attn(h, rotary, meta, k_cache, v_cache)
        if self.residual_scale != 1.0:
            h = h * self.residual_scale
        h = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        return (h * self.residual_scale if self.residual_scale != 1.0 else h), residual

    def _input_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_layernorm of the layer input, the residual stream): the first layer starts the stream with
        x; later ones add the previous layer's output to it in place, fused into the norm."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm(x, residual), residual


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3: the attention and MLP outputs are normalised too before joining the residual stream:
    x + post_attn_norm(attn(input_norm(x))), then + post_ff_norm(mlp(pre_ff_norm(.)))."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE, window: int | None = None) -> None:
        super().__init__(cfg, tp, window)
        self.pre_feedforward_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryEmbedding,
                meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self._input_norm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rotary, meta, k_cache, v_cache))
        h = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, start_layer: int = 0, end_layer: int | None = None,
                 tp: TPGroup = SINGLE, head_range: tuple[int, int] | None = None) -> None:
        """`head_range`: the vocabulary rows of the lm_head this slice computes when the head is split across
        stages (--lm-head-split): the first stage then holds rows [0, V0) (no norm: it receives normalised
        rows), the last [V0, V). None: the last slice holds the whole head (its TP shard)."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.start_layer = start_layer
        self.end_layer = cfg.num_layers if end_layer is None else end_layer
        self.is_first = start_layer == 0
        self.is_last = self.end_layer == cfg.num_layers
        self.heads = head_split(cfg.num_heads, cfg.num_kv_heads, tp.size)[tp.rank]
        self.vocab_range = shard_range(cfg.vocab_size, tp.size, tp.rank)  # of the embedding and the lm_head
        self.inter_range = shard_range(cfg.intermediate_size, tp.size, tp.rank)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if self.is_first else None
        layer_cls = SandwichDecoderLayer if cfg.sandwich_norms else DecoderLayer
        windows = cfg.layer_windows[start_layer:self.end_layer]
        self.layers = nn.ModuleList(layer_cls(cfg, tp, w) for w in windows)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.rotary_dim)
        # Gemma 3's local layers turn with their own base, unscaled (transformers' rope_local_base_freq)
        self.rotary_local = None
        if cfg.local_rope_theta is not None and any(w is not None for w in windows):
            self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta,
                                                None, cfg.rotary_dim)
        self._rotary_of = [self.rotary_local if w is not None and self.rotary_local is not None else self.rotary
                           for w in windows]
        # per layer: does it slide (its KV may live in the local pool)? [] when none does
        self._windowed = [w is not None for w in windows] if any(w is not None for w in windows) else []
        self._embed_scales: dict[torch.dtype, float] = {}
        self.head_range = head_range or self.vocab_range
        self.has_head = self.is_last or head_range is not None
        if self.is_last:
            self.norm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps)
        if self.has_head:
            a, b = self.head_range
            self.lm_head = nn.Linear(cfg.hidden_size, b - a, bias=False)

    def init_rotary(self, device: torch.device | str) -> None:
        """(Re)build the float32 rope tables on `device`: after a meta-device construction, and after the
        model is cast to bf16 (the tables stay float32)."""
        for r in (self.rotary, self.rotary_local):
            if r is not None:
                r.rebuild(device)

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """Gemma's sqrt(hidden) as transformers applies it: a float32 scalar cast to the embedding's dtype
        (bf16: 25.25 for hidden 640, not 25.298); a Python float, so CUDA graphs capture no host tensor."""
        scale = self._embed_scales.get(dtype)
        if scale is None:
            scale = self._embed_scales[dtype] = float(torch.tensor(self.cfg.embed_scale, dtype=torch.float32).to(dtype))
        return scale

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Granite's logits_scaling, then Gemma 2's final soft-cap, where the family has them."""
        if self.cfg.logits_scale != 1.0:
            logits = logits / self.cfg.logits_scale
        c = self.cfg.final_logit_softcap
        return logits if c is None else pa.soft_cap(logits, c)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """x: token ids [T] on the first stage, hidden states [T, H] elsewhere. kv_cache: [L, 2, ...], or with
        sliding-window layers in a pool of their own anything whose [i, 0] / [i, 1] are layer i's K / V cache
        (worker/model_runner.py); those layers then read meta.local's slots and block tables."""
        if self.is_first:
            x = self.embed_tokens(x)
            if self.cfg.embed_scale is not None:
                x = x * self._embed_scale(x.dtype)
        residual = None
        if not self._windowed:  # every layer global (Llama, Qwen2): the loop as it always was
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, self.rotary, meta, kv_cache[i, 0], kv_cache[i, 1])
        else:
            local = meta.local if meta.local is not None else meta
            for i, layer in enumerate(self.layers):
                m = local if self._windowed[i] else meta
                x, residual = layer(x, residual, self._rotary_of[i], m, kv_cache[i, 0], kv_cache[i, 1])
        return x + residual if residual is not None else x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head, only on the rows that are sampled: this rank's vocabulary range [S, V_rank]
        (all of it with T = 1)."""
        return self._finish_logits(self.lm_head(self.norm(hidden)))

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    @torch.inference_mode()
    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """This slice's part of the lm_head on already normalised rows (the head split across stages)."""
        return self._finish_logits(self.lm_head(normed))

    @torch.inference_mode()
    def greedy_ids(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Argmax ids over the whole vocabulary from this rank's logits (a collective with T > 1)."""
        return greedy_ids(local_logits, self.head_range[0], self.tp)

    def shard_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, end) of the checkpoint tensor `name` that this rank holds; None: all of it. Rows of
        column-parallel weights (and their biases), columns of row-parallel ones (their biases whole: rank 0
        adds them, load_weights), vocabulary rows. Tensors stored fused (Phi-3's qkv_proj, gate_up_proj) are
        read whole and cut in load_weights: a rank's part of them is several row ranges."""
        if self.tp.size == 1:
            return None
        name = canonical_name(name) or name
        hd, h = self.cfg.head_dim, self.heads
        if name.startswith("model.embed_tokens") or name.startswith("lm_head"):
            return (0, *self.vocab_range)
        proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if proj in ("o_proj", "down_proj") and name.endswith(".bias"):
            return None
        if proj == "q_proj":
            return (0, h.q_start * hd, (h.q_start + h.q_count) * hd)
        if proj in ("k_proj", "v_proj"):
            return (0, h.kv_start * hd, (h.kv_start + h.kv_count) * hd)
        if proj == "o_proj":
            return (1, h.q_start * hd, (h.q_start + h.q_count) * hd)
        if proj in ("gate_proj", "up_proj"):
            return (0, *self.inter_range)
        if proj == "down_proj":
            return (1, *self.inter_range)
        return None

    def _rank_rows(self, proj: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole fused checkpoint tensor (qkv_proj: [q | k | v] rows; gate_up_proj:
        [gate | up] rows)."""
        if self.tp.size == 1:
            return t
        hd, h, cfg = self.cfg.head_dim, self.heads, self.cfg
        if proj == "qkv_proj":
            q, k, v = t.split([cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd], dim=0)
            kv = slice(h.kv_start * hd, (h.kv_start + h.kv_count) * hd)
            return torch.cat([q[h.q_start * hd:(h.q_start + h.q_count) * hd], k[kv], v[kv]], dim=0)
        a, b = self.inter_range
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate[a:b], up[a:b]], dim=0)

    # -- loading -------------------------------------------------------------------------------------
    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")

    def wants(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to this slice (so a stage loads only its weights)."""
        name = canonical_name(name)
        if name is None:
            return False
        m = self._LAYER.match(name)
        if m:
            return self.start_layer <= int(m.group(1)) < self.end_layer
        if name.startswith("model.embed_tokens"):
            return self.is_first or (self.has_head and self.cfg.tie_word_embeddings)
        if name.startswith("lm_head"):
            return self.has_head
        return self.is_last and name.startswith("model.norm")

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()

        def put(name: str, t: torch.Tensor) -> None:
            p = params.get(name)
            if p is None:
                raise ValueError(f"checkpoint tensor {name} has no place in a {self.cfg.architecture} model")
            if p.shape != t.shape:
                raise ValueError(f"checkpoint tensor for {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(t)
            loaded.add(name)

        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        def head_rows(t: torch.Tensor) -> torch.Tensor:
            """The head's vocabulary rows of a whole [V, H] matrix (a TP rank's read is sliced already)."""
            a, b = self.head_range
            return t[a:b] if t.shape[0] == self.cfg.vocab_size and b - a < t.shape[0] else t

        for name, t in tensors:
            if not self.wants(name) or "rotary_emb" in name:
                continue
            name = canonical_name(name)
            if name.startswith("model.embed_tokens"):
                if self.is_first:
                    put("embed_tokens.weight", t)
                if self.has_head and self.cfg.tie_word_embeddings:
                    put("lm_head.weight", head_rows(t))
                continue
            if name.startswith("lm_head"):
                put("lm_head.weight", head_rows(t))
                continue
            if name.startswith("model.norm"):
                put(name.removeprefix("model."), t)
                continue
            m = self._LAYER.match(name)
            local = int(m.group(1)) - self.start_layer
            rest = m.group(2)
            mod, leaf = rest.rsplit(".", 1)  # e.g. self_attn.q_proj / weight
            parent, proj = mod.rsplit(".", 1) if "." in mod else ("", mod)
            if proj in fused:
                target, idx = fused[proj]
                key = f"layers.{local}.{parent}.{target}.{leaf}"
                group = pending.setdefault(key, {})
                group[str(idx)] = t
                if len(group) == (3 if target == "qkv_proj" else 2):
                    put(key, torch.cat([group[str(i)] for i in range(len(group))], dim=0))
                    del pending[key]
            elif proj in ("qkv_proj", "gate_up_proj"):  # stored fused (Phi-3): read whole, this rank's rows
                put(f"layers.{local}.{rest}", self._rank_rows(proj, t))
            elif leaf == "bias" and proj in ("o_proj", "down_proj") and self.tp.rank > 0:
                # row-parallel: the all-reduce sums the ranks' partial outputs, so the bias is rank 0's alone
                put(f"layers.{local}.{rest}", torch.zeros_like(t))
            else:
                put(f"layers.{local}.{rest}", t)
        missing = sorted(set(params) - loaded)
        if pending or missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:8] or sorted(pending)[:8]}")
