"""Layer partition across pipeline stages, balanced by cost rather than by layer count.

The embedding sits on the first stage and the final norm + lm_head on the last, and on small models the
lm_head is heavy: SmolLM2's tied 49152 x 576 head costs five to seven decoder layers per decode token.
But a prefill samples one row per prompt, so there the head is almost free. The engine therefore times
both at start-up (StageCosts.measure) and balances a mix: DECODE_TIME_SHARE of the time in decode, the
rest in prefill. On SmolLM2, pp=2, 1 thread per stage: decode alone would give 18/12, the mix gives 17/13.
Back to back on 128 ShareGPT-like requests (separate) 17/13 ran 8% faster than 18/12 and 16% faster than
16/14; on 512 requests the evidence is mixed (see the README), within this VM's run-to-run drift.
StageCosts.of is the FLOP-count model, for tests and machines where timing is not wanted.
"""
from __future__ import annotations

from dataclasses import dataclass

from tdpipe.config import ModelConfig

# Attention cost is charged at this context length (tokens): a typical ShareGPT-like prompt + output.
TYPICAL_CONTEXT = 512
# Assumed fraction of engine time spent in decode micro-batches (ShareGPT-like chat: about two thirds).
DECODE_TIME_SHARE = 2 / 3


@dataclass(frozen=True)
class StageCosts:
    """Cost of each piece a stage may hold, in any one unit (FLOPs for `of`, seconds for `measure`)."""

    embed: float  # the token-embedding lookup (first stage)
    layer: float  # one decoder layer: q/k/v/o + SwiGLU matmuls and attention
    head: float  # final RMSNorm + lm_head on the sampled rows (last stage)
    head_first: float = 0.0  # share of the head computed on the first stage (--lm-head-split)

    @classmethod
    def of(cls, cfg: ModelConfig, context: int = TYPICAL_CONTEXT) -> "StageCosts":
        per_layer = cfg.params_per_token_flops() / cfg.num_layers
        attn = 4 * context * cfg.num_heads * cfg.head_dim  # QK^T and PV
        return cls(embed=2.0 * cfg.hidden_size, layer=float(per_layer + attn),
                   head=2.0 * cfg.hidden_size * cfg.vocab_size)

    @classmethod
    def measure(cls, cfg: ModelConfig, dtype, threads: int, batch: int = 64, context: int = 256,
                prefill_tokens: int = 512, repeats: int = 5) -> "StageCosts":
        """Time one decoder layer, the embedding and norm + lm_head with random weights of the model's shapes
        on `threads` threads: a decode micro-batch of `batch` sequences at `context` tokens, and a prefill of
        `prefill_tokens` prompt tokens (two prompts, two sampled rows). Returns the DECODE_TIME_SHARE-weighted
        mix of the two, each normalised by its layer time. FLOP counts mislead on CPUs: the small per-layer
        ops run far below the big lm_head GEMM's efficiency."""
        import torch

        own = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            one = ModelConfig(**{**cfg.__dict__, "num_layers": 1})
            model = LlamaLike(one, dtype)
            d_embed, d_layer, d_head = model.time_step([1] * batch, [context] * batch, repeats)
            half = prefill_tokens // 2
            p_embed, p_layer, p_head = model.time_step([half, half], [half, half], repeats)
        finally:
            torch.set_num_threads(own)
        w = DECODE_TIME_SHARE
        return cls(embed=w * d_embed / d_layer + (1 - w) * p_embed / p_layer, layer=1.0,
                   head=w * d_head / d_layer + (1 - w) * p_head / p_layer)

    def stage_cost(self, num_layers: int, first: bool, last: bool) -> float:
        head = (self.head_first if first else 0.0) + (1.0 - self.head_first if last else 0.0)
        return num_layers * self.layer + (self.embed if first else 0.0) + self.head * min(1.0, head)


class LlamaLike:
    """A one-layer model of the real shapes with random weights, to time the pieces of a stage."""

    def __init__(self, cfg: ModelConfig, dtype) -> None:
        from tdpipe.model.llama import LlamaForCausalLM
        from tdpipe.model.packed_linear import pack_linears

        self.model = LlamaForCausalLM(cfg).to(dtype).eval()
        pack_linears(self.model)  # the same GEMMs the stages run
        self.model.rotary.cos_sin = self.model.rotary.cos_sin.float()  # the table stays float32
        self.cfg, self.dtype = cfg, dtype

    def time_step(self, query_lens: list[int], seq_lens: list[int], repeats: int) -> tuple[float, float, float]:
        """Best-of-`repeats` seconds for (embedding, one layer, norm + lm_head) on this micro-batch shape."""
        import time

        import torch

        from tdpipe.core.batch import StepInput
        from tdpipe.worker.model_runner import prepare_input

        bs, cfg = 16, self.cfg
        per_seq = -(-max(seq_lens) // bs)
        n = len(seq_lens)
        kv = torch.zeros((2, n * per_seq, cfg.num_kv_heads, bs, cfg.head_dim), dtype=self.dtype)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
        step = StepInput(0, [1] * sum(query_lens), query_lens, seq_lens, tables, all(q > 1 for q in query_lens))
        inp = prepare_input(step, bs, torch.device("cpu"))
        m = self.model
        layer = m.layers[0]

        def best(fn) -> float:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        with torch.inference_mode():
            x = m.embed_tokens(inp.input_ids)
            return (best(lambda: m.embed_tokens(inp.input_ids)),
                    best(lambda: layer(x, None, m.rotary, inp.meta, kv[0], kv[1])),
                    best(lambda: m.compute_logits(x[inp.sample_idx])))


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
