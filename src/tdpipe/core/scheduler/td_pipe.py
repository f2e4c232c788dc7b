"""`td-pipe`: TD-Pipe's temporally-disaggregated scheduling (TD-Pipe §3.3-3.5).

The engine stays in one phase for long stretches. In PREFILL, prompt batches go back to back (they have no
dependencies between them, so the pipeline never waits); in DECODE, the running requests are split into pp
micro-batches that cycle through the pipeline.
  Approach 1, AI-based greedy prefill (§3.3, Algorithm 1): after each prefill batch, add each request's
    predicted KV at the futurePoints (decode steps 32, 64, ..., 1024) and switch to DECODE once the
    predicted peak passes the KV capacity. Replacement for the ablation: `kv-ratio:R` (switch when the
    KV usage reaches R).
  Approach 2, inter-batch work stealing (§3.4): a returning decode batch keeps at most the average size of
    the last pp batches (the sliding window), the excess is withheld and fills later, smaller batches.
  Approach 3, spatial-temporal intensity comparison (§3.5): switch to PREFILL when the spatial intensity
    (achieved / peak per-request decode throughput at the current batch size, Eq. 1) drops below the
    temporal intensity (1 - bubble / total of switching now, Eq. 2). Replacement: `finish-ratio:R`
    (switch once R of the phase's requests finished). Variant: `reachable-intensity`, Eq. 1's Peak at the
    decode batch a switch can reach rather than the profile's largest (no thrash when KV is the limit).
The knobs (futurePoints, the two switch rules, work stealing) are TDPipeKnobs, the policy's own.
Predicted output lengths come from a `Predictor` (predictor/base.py; kept in `Sequence.predicted_output_len`
once asked). Step costs come from a `StepCostModel`, profiled on the real executor at start-up
(core/step_profile.py). Pure Python.
"""
from __future__ import annotations

import argparse
import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from tdpipe.config import SchedulerConfig
from tdpipe.core.batch import Batch
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler.registry import PolicyStat, register_policy
from tdpipe.core.scheduler.separate import SeparateScheduler
from tdpipe.options import option
from tdpipe.predictor.base import AutoPredictor, Predictor
from tdpipe.sequence import Sequence


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class StepCostModel:
    """Seconds per micro-batch on one stage: decode = d0 + d1 * batch size; prefill = p0 + p1 * tokens.
    Linear fits of the start-up profile; only ratios matter to the intensities."""

    d0: float = 0.010
    d1: float = 0.0004
    p0: float = 0.010
    p1: float = 0.0002
    peak_batch: int = 256  # "a sufficiently large batch size" for Peak (Eq. 1)
    source: str = "default"  # where the numbers come from: "default", "profile" or the cache file
    points: dict = field(default_factory=dict)  # the measured (size, seconds) pairs behind the fit

    @classmethod
    def fit(cls, decode: list[tuple[int, float]], prefill: list[tuple[int, float]], peak_batch: int,
            source: str = "profile") -> "StepCostModel":
        """Least-squares lines through (batch size, s) and (tokens, s); slopes and intercepts kept >= 0."""
        d0, d1 = _line(decode)
        p0, p1 = _line(prefill)
        return cls(d0, d1, p0, p1, peak_batch, source, {"decode": decode, "prefill": prefill})

    def decode_time(self, batch: int) -> float:
        return self.d0 + self.d1 * batch

    def prefill_time(self, tokens: int) -> float:
        return self.p0 + self.p1 * tokens


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    if len(points) < 2:
        raise ValueError("a step-cost fit needs at least two points")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / var) if var else 0.0
    return max(0.0, my - slope * mx), slope


def parse_switch(rule: str, default: str, flag: str) -> tuple[str, float]:
    """'predict' / 'intensity' or 'kv-ratio:R' / 'finish-ratio:R' -> (kind, R)."""
    if rule == default:
        return default, 0.0
    if flag == "switch_to_prefill" and rule == "reachable-intensity":
        return rule, 0.0
    kind, _, value = rule.partition(":")
    expected = "kv-ratio" if flag == "switch_to_decode" else "finish-ratio"
    try:
        r = float(value)
    except ValueError:
        r = -1.0
    if kind != expected or not 0.0 < r <= 1.0:
        extra = ", 'reachable-intensity'" if flag == "switch_to_prefill" else ""
        raise ValueError(f"{flag} must be {default!r}{extra} or '{expected}:R' with 0 < R <= 1, got {rule!r}")
    return kind, r


def _future_points(v: str) -> tuple[int, int]:
    """`--future-points STEP,MAX`."""
    try:
        step, top = (int(x) for x in v.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--future-points {v!r}: expected STEP,MAX, e.g. 32,1024") from None
    return step, top


@dataclass
class TDPipeKnobs:
    """TD-Pipe's own settings and its ablation switches (§3.3-3.5, §4.4): flags of the command line, keywords
    of LLM()."""

    future_points: tuple[int, int] = option(
        (32, 1024), "td-pipe: futurePoints, the decode steps where predicted KV usage is checked: every STEP steps "
                    "up to MAX (TD-Pipe §3.3, Algorithm 1; default: %(default)s)",
        "--future-points", type=_future_points, metavar="STEP,MAX", shown=lambda v: f"{v[0]},{v[1]}")
    switch_to_decode: str = option(
        "predict", "td-pipe: 'predict' (Approach 1, Algorithm 1) or 'kv-ratio:R', switch once KV usage reaches R "
                   "(the §4.4.1 ablation; default: %(default)s)", "--switch-to-decode")
    # "reachable-intensity": Eq. 1 with Peak at the batch a switch can reach (docs/simulator.md)
    switch_to_prefill: str = option(
        "intensity", "td-pipe: 'intensity' (Approach 3, spatial < temporal intensity, Eq. 1-2), "
                     "'reachable-intensity' (Eq. 1's Peak taken at the decode batch a switch would reach, "
                     "running + admissible requests / pp, not at the profile's largest batch), or "
                     "'finish-ratio:R', switch once R of the phase's requests finished (§4.4.3 ablation; default: "
                     "%(default)s)", "--switch-to-prefill")
    work_stealing: bool = option(
        True, "td-pipe: turn off Approach 2, inter-batch work stealing (§3.4; §4.4.2 ablation)",
        "--no-work-stealing", action="negate")

    def __post_init__(self) -> None:
        fp = self.future_points = tuple(self.future_points)  # a list from JSON is fine
        if len(fp) != 2 or not all(isinstance(x, int) for x in fp) or not 1 <= fp[0] <= fp[1]:
            raise ValueError(f"future_points must be (STEP, MAX) with 1 <= STEP <= MAX, got {fp!r}")
        parse_switch(self.switch_to_decode, "predict", "switch_to_decode")  # ValueErrors naming the field
        parse_switch(self.switch_to_prefill, "intensity", "switch_to_prefill")

    @property
    def points(self) -> list[int]:
        """The futurePoints themselves: STEP, 2 STEP, ... up to MAX (§3.3)."""
        step, top = self.future_points
        return list(range(step, top + 1, step))


def _uses_intensity(config: SchedulerConfig) -> bool:
    """Approach 3 (Eq. 1-2) compares step costs: only the intensity switches need them profiled."""
    return config.knobs.switch_to_prefill.endswith("intensity")


# The budget is prompt tokens per prefill batch: small enough that the first batch of a prefill phase, which
# the later stages wait for, is short; 2048 measured 8% faster than 8192 (docs/benchmarks.md, ablations).
@register_policy(
    "td-pipe", default_token_budget=2048, knobs=TDPipeKnobs, needs_predictor=True, needs_step_costs=_uses_intensity,
    stats=(PolicyStat("phase_switches", "num_switches", "PREFILL <-> DECODE phase switches (TD-Pipe §3.3-3.5)"),),
    help="TD-Pipe (§3.3-3.5): long prefill and decode phases, greedy prefill by predicted KV (Algorithm 1), "
         "inter-batch work stealing, spatial-temporal intensity switch (Eq. 1-2)",
    budget_help="prompt tokens per prefill batch, a longer prompt runs alone")
class TDPipeScheduler(SeparateScheduler):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 costs: StepCostModel | None = None, predictor: Predictor | None = None,
                 eos_token_ids: Iterable[int] = ()) -> None:
        super().__init__(config, block_manager, eos_token_ids)
        self.knobs: TDPipeKnobs = config.knobs or TDPipeKnobs()  # PolicySpec.build configured them
        self.costs = costs or StepCostModel()
        self.predictor = predictor or AutoPredictor()
        self.to_decode = parse_switch(self.knobs.switch_to_decode, "predict", "switch_to_decode")
        self.to_prefill = parse_switch(self.knobs.switch_to_prefill, "intensity", "switch_to_prefill")
        self.future_points = self.knobs.points  # futurePoints (§3.3)
        self.phase = Phase.PREFILL
        self.kv_usage = [0] * len(self.future_points)  # predicted blocks at each futurePoint
        self.initial: deque[list[Sequence]] = deque()  # the even split at the switch to DECODE
        self.phase_requests = 0  # requests decoding when the phase began (finish-ratio)
        self.phase_finished = 0
        self.num_switches = 0
        self._plan_key: tuple[int, int, int] | None = None  # cache of the pending-prefill plan (Eq. 2)
        self._plan: list[int] = []
        self._plan_admits = 0  # requests the pending-prefill plan admits

    # -- Approach 1: AI-based greedy prefill (Algorithm 1) ------------------------------------------------
    def predicted_len(self, seq: Sequence) -> int:
        """Predicted output length (asked once per request, kept on the sequence)."""
        if seq.predicted_output_len is None:
            seq.predicted_output_len = self.predictor.predict(seq)
        return seq.predicted_output_len

    def seq_usage(self, seq: Sequence) -> list[int]:
        """seq's predicted KV in blocks at each futurePoint. Each point stands for the steps since the previous
        one: a request still decoding anywhere in (previous point, point] counts with its largest KV there.
        Reading only the points themselves misses the peak between them (requests that finish just after
        a point still grow until then), which preempts under tight caches even with exact lengths."""
        out = [0] * len(self.future_points)
        self.update_usage(seq, out)
        return out

    def update_usage(self, seq: Sequence, usage: list[int] | None = None) -> None:
        """UpdateUsage: add seq's predicted KV (in blocks) at every futurePoint it is predicted to reach.
        Hot (the intensity switch re-plans over every running request): the loop stops at the first point
        past the request's predicted end, where every later point is zero."""
        usage = self.kv_usage if usage is None else usage
        # a request that outlives its prediction is assumed to finish within the next step
        remaining = max(self.predicted_len(seq) - len(seq.output_token_ids), 1)
        n, bs, prev = seq.num_tokens, self.bm.block_size, 0
        # blocks it shares rather than allocates: a cached prefix (or the prompt it forked from); and the
        # samples it will fork (n > 1) each grow their own blocks past the shared prompt
        shared = (seq.num_cached_tokens if seq.block_table else self.prefill_plan(seq).num_cached_tokens) // bs
        forks, full = seq.num_samples_pending - 1, n // bs
        for i, fp in enumerate(self.future_points):
            if remaining <= prev:
                break
            blocks = -(-(n + (fp if fp < remaining else remaining)) // bs)
            usage[i] += blocks - shared + (forks * (blocks - full) if forks else 0)
            prev = fp

    def would_overflow(self, seq: Sequence, usage: list[int], used_blocks: int) -> bool:
        """CheckSwitch, one request ahead: admitting seq would pass the capacity, by its predicted peak
        (Algorithm 1) or, for the ablation, by the kv-ratio."""
        if self.to_decode[0] == "kv-ratio":
            return used_blocks / max(1, self.bm.num_blocks) >= self.to_decode[1]
        add = self.seq_usage(seq)
        return max((u + a for u, a in zip(usage, add)), default=0) > self.bm.num_blocks

    def _enter_prefill(self) -> None:
        self.phase = Phase.PREFILL
        self.num_switches += 1
        self.kv_usage = [0] * len(self.future_points)
        for s in self.running:  # requests carried over from the decode phase
            self.update_usage(s)

    # whole-prompt prefill batches come from SeparateScheduler, with Algorithm 1 hooked in. The check looks
    # one request ahead: a request is admitted only if the predicted peak stays within the capacity, so a
    # correct prediction never preempts. One request is always admitted into an empty engine (progress).
    def prefill_closed(self, seq: Sequence) -> bool:
        if not self.running:
            return False
        return self.would_overflow(seq, self.kv_usage, self.bm.num_used_blocks)

    def on_prefill_admit(self, seq: Sequence) -> None:
        self.update_usage(seq)

    # -- Approach 2: inter-batch work stealing ----------------------------------------------------------------
    def _enter_decode(self) -> None:
        self.phase = Phase.DECODE
        self.num_switches += 1
        ready = [s for s in self.running if not s.in_flight]
        pp = self.config.pipeline_depth
        self.initial = deque(g for g in (ready[i::pp] for i in range(pp)) if g)  # even split
        self.phase_requests = len(self.running)
        self.phase_finished = 0

    def _decode_batch(self) -> list[Sequence]:
        ready = [s for s in self.running if not s.in_flight and s.num_computed_tokens == s.num_tokens - 1]
        if self.initial:
            ids = {s.seq_id for s in ready}
            chosen = [s for s in self.initial.popleft() if s.seq_id in ids] or ready
        elif self.knobs.work_stealing:
            # the sliding window's average (the last pp batch sizes, finished requests dropped) is the live
            # requests over pp batches, so it is computed from them directly rather than kept as state
            live = sum(1 for s in self.running if s.num_computed_tokens >= s.num_tokens - 1)
            target = -(-live // self.config.pipeline_depth)
            chosen = ready[:target]  # the excess stays withheld for the next, smaller batches
        else:
            chosen = ready  # no stealing: each batch keeps whatever survived in it
        return chosen[: self.config.max_num_seqs]

    # -- Approach 3: spatial-temporal intensity comparison --------------------------------------------------
    def spatial_intensity(self, batch: int, peak_batch: int | None = None) -> float:
        """Eq. 1: achieved / peak per-request decode throughput (peak at `peak_batch`, default the profile's)."""
        c = self.costs
        pb = c.peak_batch if peak_batch is None else peak_batch
        achieved = batch / c.decode_time(batch)
        peak = pb / c.decode_time(pb)
        return achieved / peak

    def reachable_batch(self) -> int:
        """The decode micro-batch a switch now would lead to: the running requests plus those the pending
        prefills admit, over pp micro-batches. `reachable-intensity` takes Eq. 1's Peak there instead of at
        the profile's largest batch: when the KV cache, not the phase, limits the batch, a switch cannot
        reach that Peak, and comparing with it switches after every decode round (docs/simulator.md)."""
        self.pending_prefills()
        n = len(self.running) + self._plan_admits
        return max(1, min(self.costs.peak_batch, self.config.max_num_seqs, -(-n // self.config.pipeline_depth)))

    def pending_prefills(self) -> list[int]:
        """Token counts of the prefill batches a switch now would run: Algorithm 1 (or the kv-ratio rule)
        simulated from the current state over the waiting queue, as the next prefill phase would admit them
        (within today's free KV too). Recomputed only when the running or waiting set changes."""
        key = (len(self.running), len(self.waiting), self.phase_finished)
        if key == self._plan_key:
            return self._plan
        start = self.num_seqs()
        usage = [0] * len(self.future_points)
        for s in self.running:
            self.update_usage(s, usage)
        used, free = self.bm.num_used_blocks, self.bm.num_free_blocks - self.watermark_blocks
        batches, cur, n_seqs = [], 0, start
        for s in self.waiting:
            plan = self.prefill_plan(s)  # what it really prefills and allocates (prefix caching)
            need, tokens = plan.num_new_blocks, s.num_tokens - plan.num_cached_tokens
            if (n_seqs + s.num_samples_pending > self.config.max_num_seqs or need > free
                    or (n_seqs and self.would_overflow(s, usage, used))):
                break
            self.update_usage(s, usage)
            used, free, n_seqs = used + need, free - need, n_seqs + s.num_samples_pending
            if cur and cur + tokens > self.config.max_num_batched_tokens:
                batches.append(cur)
                cur = 0
            cur += tokens
        if cur:
            batches.append(cur)
        self._plan_key, self._plan, self._plan_admits = key, batches, n_seqs - start
        return batches

    def temporal_intensity(self, batch: int) -> float:
        """Eq. 2: 1 - bubble / total for a switch now. bubble = longest pending prefill - current decode step;
        total = the pending prefills + one decode step per batch + bubble."""
        c = self.costs
        batches = self.pending_prefills()
        if not batches:
            return 0.0
        times = [c.prefill_time(t) for t in batches]
        bubble = max(0.0, max(times) - c.decode_time(batch))
        total = sum(times) + self.config.pipeline_depth * c.decode_time(batch) + bubble
        return 1.0 - bubble / total

    def should_prefill(self, batch: int, in_flight: bool = False) -> bool:
        """Leave DECODE now? `in_flight`: nothing is ready because every decode batch is in the pipeline."""
        if not self.waiting:
            return False
        if not self.running:
            return True
        if in_flight:
            return False
        if self.to_prefill[0] == "finish-ratio":
            return self.phase_finished >= self.to_prefill[1] * max(1, self.phase_requests)
        if self.to_prefill[0] == "reachable-intensity":
            peak = self.reachable_batch()
            return peak > batch and self.spatial_intensity(batch, peak) < self.temporal_intensity(batch)
        return self.spatial_intensity(batch) < self.temporal_intensity(batch)

    # -- the policy ---------------------------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        if self.phase is Phase.PREFILL:
            batch = self._schedule_prefill()
            if batch is not None:
                return batch
            self._enter_decode()  # predicted peak reached, nothing waits, or nothing more fits now
            return self._schedule_decode(allow_switch=False)
        return self._schedule_decode(allow_switch=True)

    def _schedule_decode(self, allow_switch: bool) -> Batch | None:
        ready = self._decode_batch()
        if allow_switch and not self.initial and self.should_prefill(len(ready), in_flight=not ready):
            self._enter_prefill()
            batch = self._schedule_prefill()
            if batch is not None:
                return batch
            self._enter_decode()  # nothing could be prefilled after all: keep decoding
            ready = self._decode_batch()
        chosen = self._reserve_decode_slots(ready)
        if not chosen:
            return None
        for s in chosen:
            s.in_flight = True
        return Batch(self.next_batch_id(), chosen, [1] * len(chosen), is_prefill=False)

    def on_result(self, batch: Batch) -> None:
        if not batch.is_prefill:
            self.phase_finished += sum(1 for s in batch.seqs if s.is_finished)
        super().on_result(batch)
        if self.phase is Phase.PREFILL and not self.waiting and not self.running:
            self.kv_usage = [0] * len(self.future_points)

    def reset_idle(self) -> None:
        """Every request was aborted: no predicted KV is left, and the next request opens a prefill phase."""
        self.phase = Phase.PREFILL
        self.initial.clear()
        self.kv_usage = [0] * len(self.future_points)


__all__ = ["Phase", "StepCostModel", "TDPipeKnobs", "TDPipeScheduler", "parse_switch"]
