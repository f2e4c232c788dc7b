"""Layer partition across pipeline stages, balanced by cost rather than by layer count.

The embedding sits on the first stage and the final norm + lm_head on the last, and on small models the
lm_head is heavy: SmolLM2's tied 49152 x 576 head costs about seven decoder layers per token. Splitting
30 layers 15/15 would leave the first stage idle a third of the time; cost balancing gives 18/12.
"""
from __future__ import annotations

from dataclasses import dataclass

from tdpipe.config import ModelConfig

# Attention cost is charged at this context length (tokens): a typical ShareGPT-like prompt + output.
TYPICAL_CONTEXT = 512


@dataclass(frozen=True)
class StageCosts:
    """Per-token cost in FLOPs of each piece a stage may hold."""

    embed: float  # a row lookup: memory, charged as 2H
    layer: float  # q/k/v/o + SwiGLU matmuls and attention scores over TYPICAL_CONTEXT tokens
    head: float  # final RMSNorm + lm_head (2 H V) on the sampled row

    @classmethod
    def of(cls, cfg: ModelConfig, context: int = TYPICAL_CONTEXT) -> "StageCosts":
        per_layer = cfg.params_per_token_flops() / cfg.num_layers
        attn = 4 * context * cfg.num_heads * cfg.head_dim  # QK^T and PV
        return cls(embed=2.0 * cfg.hidden_size, layer=float(per_layer + attn),
                   head=2.0 * cfg.hidden_size * cfg.vocab_size)

    @classmethod
    def measure(cls, cfg: ModelConfig, dtype, threads: int, batch: int = 64, context: int = 256,
                repeats: int = 5) -> "StageCosts":
        """Time one decoder layer, the embedding and norm + lm_head on a decode micro-batch of `batch`
        sequences at `context` tokens, with random weights of the model's shapes and `threads` threads.
        FLOP counts mislead on CPUs: small per-layer ops run far below the big lm_head GEMM's efficiency
        (on SmolLM2, batch 32: the head costs ~3 layers, not ~7)."""
        import time

        import torch

        from tdpipe.core.batch import StepInput
        from tdpipe.model.llama import LlamaForCausalLM
        from tdpipe.worker.model_runner import prepare_input

        own = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            one = ModelConfig(**{**cfg.__dict__, "num_layers": 1})
            model = LlamaForCausalLM(one).to(dtype).eval()
            model.rotary.cos_sin = model.rotary.cos_sin.float()  # the table stays float32
            bs = 16
            per_seq = -(-context // bs)
            kv = torch.zeros((1, 2, batch * per_seq, cfg.num_kv_heads, bs, cfg.head_dim), dtype=dtype)
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
            step = StepInput(0, [1] * batch, [1] * batch, [context] * batch, tables, False)
            inp = prepare_input(step, bs, torch.device("cpu"))
            x = model.embed_tokens(inp.input_ids)
            layer = model.layers[0]

            def best(fn) -> float:
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                return min(times)

            with torch.inference_mode():
                t_embed = best(lambda: model.embed_tokens(inp.input_ids))
                t_layer = best(lambda: layer(x, None, model.rotary, inp.meta, kv[0, 0], kv[0, 1]))
                t_head = best(lambda: model.compute_logits(x))
        finally:
            torch.set_num_threads(own)
        return cls(embed=t_embed, layer=t_layer, head=t_head)

    def stage_cost(self, num_layers: int, first: bool, last: bool) -> float:
        return num_layers * self.layer + (self.embed if first else 0.0) + (self.head if last else 0.0)


def balanced_partition(cfg: ModelConfig, pp: int, costs: StageCosts | None = None) -> list[int]:
    """Layers per stage (contiguous, >= 1 each) minimising the most expensive stage, ties broken towards
    equal stages (smaller sum of squared stage costs). Dynamic programming over (stage, layers used)."""
    n = cfg.num_layers
    if pp > n:
        raise ValueError(f"pipeline_parallel_size ({pp}) exceeds the model's {n} layers")
    c = costs or StageCosts.of(cfg)
    # best[k][j]: (max cost, sum of squares, split) placing the first j layers on stages 0..k
    best: list[dict[int, tuple[float, float, list[int]]]] = [{} for _ in range(pp)]
    for j in range(1, n - pp + 2):
        cost = c.stage_cost(j, True, pp == 1)
        best[0][j] = (cost, cost * cost, [j])
    for k in range(1, pp):
        last = k == pp - 1
        for j in range(k + 1, n - (pp - 1 - k) + 1):
            if last and j != n:
                continue
            for prev, (mx, sq, split) in best[k - 1].items():
                m = j - prev
                if m < 1:
                    continue
                cost = c.stage_cost(m, False, last)
                cand = (max(mx, cost), sq + cost * cost, split + [m])
                if j not in best[k] or cand[:2] < best[k][j][:2]:
                    best[k][j] = cand
    return best[pp - 1][n][2]


def resolve_partition(cfg: ModelConfig, pp: int, layer_partition: list[int] | None,
                      costs: StageCosts | None = None) -> list[tuple[int, int]]:
    """[start, end) layer ranges per stage, from an explicit --layer-partition or the cost balance."""
    if pp > cfg.num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp}) exceeds the model's {cfg.num_layers} layers")
    if layer_partition is None:
        counts = balanced_partition(cfg, pp, costs)
    else:
        counts = list(layer_partition)
        if len(counts) != pp:
            raise ValueError(f"layer_partition {counts} has {len(counts)} entries; pipeline_parallel_size is {pp}")
        if any(m < 1 for m in counts) or sum(counts) != cfg.num_layers:
            raise ValueError(f"layer_partition {counts} must give every stage at least one layer and sum to "
                             f"the model's {cfg.num_layers} layers (it sums to {sum(counts)})")
    ranges, start = [], 0
    for m in counts:
        ranges.append((start, start + m))
        start += m
    return ranges
