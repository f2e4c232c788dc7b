"""Roofline cost of one micro-batch on one pipeline stage (the simulator's stand-in for running it).

Per decoder layer, each part costs the larger of its compute time and its memory time:
  linear    2 * T * P_layer / tp FLOPs at flops * flops_eff, against P_layer * bytes / tp weight bytes at
            mem_bw * bw_eff (T = tokens in the micro-batch, P_layer = the layer's weights);
  attention 4 * q * (cached + (q + 1) / 2) * heads * head_dim / tp FLOPs per sequence (causal: a query sees
            the cached prefix and half its own chunk on average) at flops * attn_eff, against the KV the
            sequence reads (its whole context, K and V) at mem_bw * bw_eff;
  all-reduce with tp > 1, two per layer (after attention and after the MLP, Megatron-style), each
            allreduce_latency + 2 (tp - 1) / tp * T * hidden * bytes / allreduce_bw (ring);
  overhead  layer_overhead (launches, norms, rotary, activations).
The first stage adds the embedding gather, the last the lm_head over one row per sequence (a roofline
GEMM like the linear layers). Every stage adds step_overhead, and the sum is scaled by the device's
measured in-pipeline `slowdown` (1 on GPUs). A stage's output to the next costs
link_latency + T * hidden * bytes / link_bw.
"""
from __future__ import annotations

from dataclasses import dataclass

from tdpipe.config import ModelConfig
from tdpipe.sim.device import Hardware


def check_tensor_parallel(mc: ModelConfig, tp: int, model: str | None = None) -> None:
    """Fail when `tp` devices cannot split the model Megatron-style: every rank needs a whole number of
    query heads and of MLP columns, and KV heads must either divide evenly or be replicated evenly (tp a
    multiple of the KV heads: each rank keeps one, as vLLM does). Otherwise the cost model would price a
    deployment that cannot exist."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor parallel size must be an integer >= 1, got {tp!r}")
    name = f"{model}: " if model else ""
    parts = [("attention heads", mc.num_heads), ("intermediate_size (MLP columns)", mc.intermediate_size)]
    bad = [f"{n} {what}" for what, n in parts if n % tp]
    if mc.num_kv_heads % tp and tp % mc.num_kv_heads:
        bad.append(f"{mc.num_kv_heads} KV heads")
    if bad:
        raise ValueError(f"{name}tensor parallel size {tp} cannot split the model: its {' and '.join(bad)} "
                         f"are not divisible by {tp}; use a tp that divides heads {mc.num_heads} and "
                         f"intermediate_size {mc.intermediate_size}, and divides or is a multiple of KV heads "
                         f"{mc.num_kv_heads}, or --pp")


def kv_heads_per_device(mc: ModelConfig, tp: int) -> float:
    """KV heads one rank stores: split when tp <= KV heads, else one (replicated tp / KV heads times)."""
    return mc.num_kv_heads / tp if tp <= mc.num_kv_heads else 1


def layer_params(mc: ModelConfig) -> int:
    """Weights of one decoder layer: attention projections (with their biases, as Qwen2's), SwiGLU MLP, 2 norms."""
    h, i = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return h * (q + 2 * kv) + mc.layer_bias_params() + q * h + 3 * h * i + 2 * h


def model_bytes(mc: ModelConfig, dtype_bytes: int = 2) -> int:
    """All weights: layers, embedding, final norm and (untied) lm_head."""
    head = 0 if mc.tie_word_embeddings else mc.vocab_size * mc.hidden_size
    return dtype_bytes * (mc.num_layers * layer_params(mc) + mc.vocab_size * mc.hidden_size + mc.hidden_size + head)


def stage_weight_bytes(mc: ModelConfig, layers: int, first: bool, last: bool, dtype_bytes: int = 2) -> int:
    b = layers * layer_params(mc)
    if first:
        b += mc.vocab_size * mc.hidden_size
    if last:
        b += mc.hidden_size + (0 if mc.tie_word_embeddings and first else mc.vocab_size * mc.hidden_size)
    return dtype_bytes * b


@dataclass
class StepShape:
    """What the cost of a micro-batch depends on, summed over its sequences once per step."""

    tokens: int  # query tokens (prefill chunk lengths + 1 per decode)
    rows: int  # sequences (one lm_head row each)
    attn_qk: float  # sum over sequences of q * (cached + (q + 1) / 2): attention score pairs
    kv_tokens: int  # sum over sequences of the context read (tokens with KV after the step)

    @classmethod
    def of(cls, query_lens: list[int], seq_lens: list[int]) -> "StepShape":
        qk = 0.0
        for q, s in zip(query_lens, seq_lens):
            qk += q * (s - q + (q + 1) / 2)
        return cls(sum(query_lens), len(query_lens), qk, sum(seq_lens))


class CostModel:
    """Seconds per micro-batch per stage for one model on one device kind, with `tp` devices per stage."""

    def __init__(self, mc: ModelConfig, hw: Hardware, partition: list[tuple[int, int]], tp: int = 1,
                 dtype_bytes: int = 2) -> None:
        check_tensor_parallel(mc, tp)
        self.mc, self.hw, self.tp, self.b = mc, hw, tp, dtype_bytes
        self.layers = [e - s for s, e in partition]
        self.num_stages = len(partition)
        self._flops = hw.flops * hw.flops_eff
        self._attn_flops = hw.flops * hw.attn_eff
        self._bw = hw.mem_bw * hw.bw_eff
        self.layer_w = layer_params(mc) / tp  # weights per layer per device
        self.head_w = mc.vocab_size * mc.hidden_size / tp
        self.attn_per_pair = 4 * mc.num_heads * mc.head_dim / tp  # FLOPs per (query, key) pair per layer
        self.kv_per_token = 2 * kv_heads_per_device(mc, tp) * mc.head_dim * dtype_bytes  # bytes per layer
        spans_nodes = hw.node_size and tp > hw.node_size and hw.internode_bw
        self.allreduce_bw = hw.internode_bw if spans_nodes else hw.allreduce_bw  # a ring is as slow as its slowest hop

    def roofline(self, flops: float, nbytes: float, flops_rate: float | None = None) -> float:
        return max(flops / (flops_rate or self._flops), nbytes / self._bw)

    def allreduce_time(self, s: StepShape) -> float:
        """The two all-reduces of one layer (after attention, after the MLP) over the tp ranks (ring)."""
        if self.tp == 1:
            return 0.0
        ring = 2 * (self.tp - 1) / self.tp * s.tokens * self.mc.hidden_size * self.b
        return 2 * (self.hw.allreduce_latency + ring / self.allreduce_bw)

    def layer_time(self, s: StepShape) -> float:
        t = self.roofline(2 * s.tokens * self.layer_w, self.layer_w * self.b)
        t += self.roofline(s.attn_qk * self.attn_per_pair, s.kv_tokens * self.kv_per_token, self._attn_flops)
        return t + self.allreduce_time(s) + self.hw.layer_overhead

    def head_time(self, s: StepShape) -> float:
        return self.roofline(2 * s.rows * self.head_w, self.head_w * self.b)

    def stage_times(self, s: StepShape) -> list[float]:
        """Compute seconds of the micro-batch on each stage."""
        per_layer = self.layer_time(s)
        out = [n * per_layer + self.hw.step_overhead for n in self.layers]
        out[0] += s.tokens * self.mc.hidden_size * self.b / self._bw  # embedding gather
        out[-1] += self.head_time(s)
        if self.hw.slowdown != 1.0:
            out = [t * self.hw.slowdown for t in out]
        return out

    def stage_allreduce(self, s: StepShape) -> list[float]:
        """The all-reduce part of stage_times (TD-Pipe Fig. 6's communication share)."""
        per_layer = self.allreduce_time(s) * self.hw.slowdown
        return [n * per_layer for n in self.layers]

    def send_times(self, s: StepShape) -> list[float]:
        """Activation transfer from stage k to k + 1 (hidden states of every query token): tp rank t sends to
        tp rank t of the next stage, over the node's link or, when that pair sits on two nodes, the NIC."""
        nbytes = s.tokens * self.mc.hidden_size * self.b
        out = []
        for k in range(self.num_stages - 1):
            crosses = self.hw.node_size and self.hw.internode_bw and any(
                (k * self.tp + t) // self.hw.node_size != ((k + 1) * self.tp + t) // self.hw.node_size
                for t in range(self.tp))
            out.append(self.hw.link_latency + nbytes / (self.hw.internode_bw if crosses else self.hw.link_bw))
        return out


__all__ = ["CostModel", "StepShape", "check_tensor_parallel", "kv_heads_per_device", "layer_params", "model_bytes",
           "stage_weight_bytes"]
