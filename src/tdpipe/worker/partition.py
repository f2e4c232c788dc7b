"""Layer partition across pipeline stages, balanced by cost rather than by layer count.

The embedding sits on the first stage and the final norm + lm_head on the last, and on small models the
lm_head is heavy: SmolLM2's tied 49152 x 576 head costs five to seven decoder layers per decode token.
But a prefill samples one row per prompt, so there the head is almost free. No single split balances
both phases: balancing decode overloads the first stage in prefill, and the reverse. So the engine times
both at start-up (StageCosts.measure, kept on disk by worker/partition_cache.py) and minimises the time of
the phases one after the other, DECODE_TIME_SHARE x (slowest stage in decode) + the rest x (slowest stage
in prefill) (PhaseCosts), not the slowest stage of a blended cost, which hides an imbalance that flips
between the phases.

The lm_head split (--lm-head-split) is the second knob: a share of the head's vocabulary computed on the
first stage moves decode work only (prefill samples few rows), so layers can balance prefill and the split
decode. `auto` (the default) picks it with the layers (choose_head_split), and only where the model says it
saves more than SPLIT_MIN_GAIN: the split adds a hop (last stage -> first -> engine) per micro-batch that
the model does not price. AMD EPYC, float32, 256 ShareGPT-like requests, throttle, pp = 2: 16/14 unsplit ->
15/15 with half the head on stage 0, bubble 0.085 -> 0.067 (decode phase 0.063 -> 0.039); against pp = 1 in
the same run, 0.947x -> 0.966x (docs/benchmarks.md, "Pipeline efficiency").
StageCosts.of is the FLOP-count model, for tests and machines where timing is not wanted.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tdpipe.config import ModelConfig
from tdpipe.platforms import get_platform

if TYPE_CHECKING:
    from tdpipe.platforms.interface import Platform

# Attention cost is charged at this context length (tokens): a typical ShareGPT-like prompt + output.
TYPICAL_CONTEXT = 512
# Assumed fraction of engine time spent in decode micro-batches (ShareGPT-like chat: about two thirds).
DECODE_TIME_SHARE = 2 / 3
# Head-split shares `auto` tries (share of the vocabulary on the first stage), and the modelled saving it
# needs before it splits at all: the extra hop per micro-batch is not in the model.
SPLIT_GRID = tuple(i / 20 for i in range(17))  # 0, 0.05, ..., 0.8
SPLIT_MIN_GAIN = 0.01


@dataclass(frozen=True)
class StageCosts:
    """Cost of each piece a stage may hold in one phase, in any one unit (FLOPs for `of`, layer times for
    `measure`)."""

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
                prefill_tokens: int = 512, repeats: int = 5, platform: Platform | None = None) -> "PhaseCosts":
        """Time one decoder layer, the embedding and norm + lm_head with random weights of the model's shapes
        on `threads` threads: a decode micro-batch of `batch` sequences at `context` tokens, and a prefill of
        `prefill_tokens` prompt tokens (two prompts, two sampled rows); each phase in units of its layer
        time. FLOP counts mislead on CPUs: the small per-layer ops run far below the big lm_head GEMM's
        efficiency. `platform`: the device the stages will run on (None: this CPU)."""
        import torch

        own = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            one = replace(cfg, num_layers=1, layer_windows=cfg.layer_windows[:1])
            model = LlamaLike(one, dtype, platform)
            d_embed, d_layer, d_head = model.time_step([1] * batch, [context] * batch, repeats)
            half = prefill_tokens // 2
            p_embed, p_layer, p_head = model.time_step([half, half], [half, half], repeats)
        finally:
            torch.set_num_threads(own)
        return PhaseCosts(decode=cls(d_embed / d_layer, 1.0, d_head / d_layer),
                          prefill=cls(p_embed / p_layer, 1.0, p_head / p_layer))

    def stage_cost(self, num_layers: int, first: bool, last: bool) -> float:
        head = (self.head_first if first else 0.0) + (1.0 - self.head_first if last else 0.0)
        return num_layers * self.layer + (self.embed if first else 0.0) + self.head * min(1.0, head)


@dataclass(frozen=True)
class PhaseCosts:
    """Decode and prefill costs, each in units of its own layer time: a pipeline runs at the pace of its
    slowest stage in each phase, so a partition costs DECODE_TIME_SHARE x decode's slowest stage + the rest
    x prefill's (a split balanced on a blend of the two can leave both phases imbalanced)."""

    decode: StageCosts
    prefill: StageCosts
    decode_share: float = DECODE_TIME_SHARE

    def with_split(self, head_first: float) -> "PhaseCosts":
        return PhaseCosts(replace(self.decode, head_first=head_first),
                          replace(self.prefill, head_first=head_first), self.decode_share)

    def time(self, counts: list[int]) -> float:
        """Modelled time of the two phases for these layers per stage (in layer times)."""
        pp = len(counts)
        return sum(w * max(c.stage_cost(m, k == 0, k == pp - 1) for k, m in enumerate(counts))
                   for w, c in ((self.decode_share, self.decode), (1 - self.decode_share, self.prefill)))


def balanced_partition(cfg: ModelConfig, pp: int, costs: StageCosts | PhaseCosts | None = None) -> list[int]:
    """Layers per stage (contiguous, >= 1 each) minimising the slowest stage (PhaseCosts: the two phases'
    time, PhaseCosts.time), ties broken towards equal stages (smaller sum of squared stage costs). Dynamic
    programming over (stage, layers used), keeping per state every (slowest in decode, slowest in prefill,
    sum of squares) that no other beats in all three, which makes the result exact."""
    n = cfg.num_layers
    if pp > n:
        raise ValueError(f"pipeline_parallel_size ({pp}) exceeds the model's {n} layers")
    c = costs or StageCosts.of(cfg)
    ph = c if isinstance(c, PhaseCosts) else PhaseCosts(c, c, 1.0)
    w = ph.decode_share

    def cost(m: int, first: bool, last: bool) -> tuple[float, float]:
        return ph.decode.stage_cost(m, first, last), ph.prefill.stage_cost(m, first, last)

    def keep(front: list[tuple], cand: tuple) -> None:
        """Add `cand` (maxD, maxP, sumsq, split) to a Pareto front unless an entry is as good in all three."""
        if any(f[0] <= cand[0] and f[1] <= cand[1] and f[2] <= cand[2] for f in front):
            return
        front[:] = [f for f in front if not (cand[0] <= f[0] and cand[1] <= f[1] and cand[2] <= f[2])]
        front.append(cand)

    # best[k][j]: the fronts of placing the first j layers on stages 0..k
    best: list[dict[int, list[tuple[float, float, float, list[int]]]]] = [{} for _ in range(pp)]
    for j in range(1, n - pp + 2):
        d, p = cost(j, True, pp == 1)
        s = w * d + (1 - w) * p
        best[0][j] = [(d, p, s * s, [j])]
    for k in range(1, pp):
        last = k == pp - 1
        for j in range(k + 1, n - (pp - 1 - k) + 1):
            if last and j != n:
                continue
            front: list[tuple] = []
            for prev, entries in best[k - 1].items():
                m = j - prev
                if m < 1:
                    continue
                d, p = cost(m, False, last)
                s = w * d + (1 - w) * p
                for md, mp, sq, split in entries:
                    keep(front, (max(md, d), max(mp, p), sq + s * s, split + [m]))
            best[k][j] = front
    return min(best[pp - 1][n], key=lambda e: (w * e[0] + (1 - w) * e[1], e[2]))[3]


def choose_head_split(cfg: ModelConfig, pp: int, costs: PhaseCosts, layer_partition: list[int] | None = None,
                      grid: tuple[float, ...] = SPLIT_GRID,
                      min_gain: float = SPLIT_MIN_GAIN) -> tuple[float, list[int]]:
    """`--lm-head-split auto`: the share of the head on the first stage, and the layers that go with it
    (`layer_partition` if given), with the least modelled time (PhaseCosts.time); 0 unless some share saves
    more than `min_gain` of it."""
    def plan(f: float) -> tuple[float, list[int]]:
        c = costs.with_split(f)
        counts = list(layer_partition) if layer_partition else balanced_partition(cfg, pp, c)
        return c.time(counts), counts

    t0, counts0 = plan(0.0)
    best = (t0, 0.0, counts0)
    for f in grid:
        if f > 0:
            t, counts = plan(f)
            if t < best[0]:
                best = (t, f, counts)
    if best[0] > t0 * (1 - min_gain):
        return 0.0, counts0
    return best[1], best[2]


class LlamaLike:
    """A one-layer model of the real shapes with random weights, to time the pieces of a stage."""

    def __init__(self, cfg: ModelConfig, dtype, platform: Platform | None = None) -> None:
        from tdpipe.model.llama import LlamaForCausalLM
        from tdpipe.model.quantization import prepare_linears

        self.platform = platform or get_platform("cpu")
        self.device = self.platform.torch_device(0)
        self.model = LlamaForCausalLM(cfg).to(dtype).to(self.device).eval()
        prepare_linears(self.model, cfg.quantization)  # the same GEMMs the stages run
        self.model.init_rotary(self.device)  # the rope tables stay float32
        self.cfg, self.dtype = cfg, dtype

    def time_step(self, query_lens: list[int], seq_lens: list[int], repeats: int) -> tuple[float, float, float]:
        """Best-of-`repeats` seconds for (embedding, one layer, norm + lm_head) on this micro-batch shape."""
        import time

        import torch

        from tdpipe.step_input import StepInput
        from tdpipe.worker.model_runner import prepare_input

        bs, cfg = 16, self.cfg
        per_seq = -(-max(seq_lens) // bs)
        n = len(seq_lens)
        kv = torch.zeros((2, n * per_seq, cfg.num_kv_heads, bs, cfg.head_dim), dtype=self.dtype, device=self.device)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
        step = StepInput(0, [1] * sum(query_lens), query_lens, seq_lens, tables, all(q > 1 for q in query_lens))
        inp = prepare_input(step, bs, self.device)
        m = self.model
        layer = m.layers[0]
        sync = self.platform.synchronize

        def best(fn) -> float:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - t0)
            return min(times)

        with torch.inference_mode():
            x = m.embed_tokens(inp.input_ids)
            return (best(lambda: m.embed_tokens(inp.input_ids)),
                    best(lambda: layer(x, None, m.rotary, inp.meta, kv[0], kv[1])),
                    best(lambda: m.compute_logits(x[inp.sample_idx])))


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
