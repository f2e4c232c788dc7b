"""Start-up profile of step costs on the actual executor, for TD-Pipe's intensity comparison (§3.5).

Eq. 1 needs the decode time per batch size and Eq. 2 the prefill time per token count. Both are measured
here by running dummy requests through the engine's own executor (all stages, real KV cache, real
transport) with nothing else in flight, then fitted with lines (`StepCostModel.fit`). The time of one
micro-batch is its latency through the pipeline divided by the number of stages: the per-stage time the
scheduler reasons about.

What is measured is a `Plan` (prompt length, decode batch sizes, requests per prefill batch) and the times
depend only on it and on what runs it (model files, dtype, partition, threads, block size, kernels, CPU).
The plan is the same for every engine whose KV cache holds it, whatever its capacity or max_num_seqs; the
limits of the engine at hand are applied when a profile is used (`limit`: Eq. 1's Peak is never past the
decode micro-batch this engine can form). Only a cache too small for the standard plan measures a smaller
one, cached under its own key (the plan is part of the key), so a small-KV run never changes the profile
a normal run loads. The result is cached in $TDPIPE_CACHE/profiles, validated on load (a damaged file is
measured again and overwritten), so only the first start pays the few seconds.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

from tdpipe.config import ModelConfig, SchedulerConfig
from tdpipe.core.batch import Batch
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler.td_pipe import StepCostModel
from tdpipe.executor.base import Executor
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence

log = logging.getLogger("tdpipe")
PROFILE_VERSION = 3  # 3: the plan in the key, measured independently of KV capacity and max_num_seqs
CONTEXT = 64  # prompt tokens per dummy request (decode attention reads this much KV)
REPEATS = 3
MAX_BATCH = 128  # Peak's "sufficiently large batch" (Eq. 1) on a CPU: keeps the start-up short
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# KV tokens one dummy request is budgeted: its prompt and REPEATS decode steps at up to 16 batch sizes.
# Also what `kv_batch` counts Peak in, so Peak is the same whether the profile was measured here or loaded.
ROOM = CONTEXT + 2 * REPEATS * 8 + 1


@dataclasses.dataclass
class ProfileTarget:
    """What a profile runs on and is keyed by: the parts of an engine being built (core/engine_builder.py),
    before its scheduler exists (the scheduler is given the result)."""

    executor: Executor
    block_manager: BlockManager
    scheduler_config: SchedulerConfig  # the token budget shapes the plan; max_num_seqs limits Peak
    model_config: ModelConfig
    model_path: str
    dtype: Any  # torch.dtype
    pp: int
    partition: list[tuple[int, int]]
    stage_threads: list[int]
    new_seq_id: Callable[[], int]  # the engine's sequence ids: the dummy requests take their own

    @classmethod
    def of(cls, engine: Any) -> "ProfileTarget":
        """A built engine's parts (an LLMEngine has them all): what its profile was keyed by."""
        return cls(engine.executor, engine.block_manager, engine.scheduler.config, engine.model_config,
                   engine.model_path, engine.dtype, engine.pp, engine.partition, engine.stage_threads,
                   engine._seq_ids.__next__)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a profile measures: `context`-token prompts prefilled `prefill[i]` requests at a time, then
    decoded REPEATS times at each batch size in `decode`. Everything a profile's points depend on besides
    the machine and the executor, so it is part of the cache key."""

    context: int
    decode: tuple[int, ...]
    prefill: tuple[int, ...]

    @property
    def requests(self) -> int:
        return max(self.decode)

    @property
    def room(self) -> int:
        """KV tokens the first request reaches (it takes part in every decode size)."""
        return self.context + REPEATS * len(self.decode)


def cache_dir() -> Path:
    """$TDPIPE_CACHE/profiles (default ~/.cache/tdpipe/profiles), beside the converted models and kernels."""
    from tdpipe.model.cache import profiles_dir

    return profiles_dir()


def kv_batch(bm: BlockManager) -> int:
    """Dummy requests of ROOM tokens the KV cache holds, one block spare (0: not even one); in both pools
    when sliding-window layers have their own (core/window_blocks.py: block 0 is its null block)."""
    n = (bm.num_blocks - 1) // bm.blocks_needed(ROOM)
    wp = bm.window_pool
    return n if wp is None else min(n, (wp.num_blocks - 2) // bm.blocks_needed(ROOM))


def _plan(n: int, context: int, budget: int) -> Plan:
    """n requests of `context` tokens: decode at the SIZES up to n and n itself; prefill batches of
    1, 2, 4, ... requests within the token budget."""
    decode = tuple(sorted({b for b in SIZES if b <= n} | {n}))
    per_batch, prefill, done, k = max(1, budget // context), [], 0, 1
    while done < n:
        prefill.append(min(k, per_batch, n - done))
        done += prefill[-1]
        k *= 2
    return Plan(context, decode, tuple(prefill))


def standard_plan(target: ProfileTarget) -> Plan:
    """The plan every engine whose KV cache holds it measures (only the token budget shapes it)."""
    return _plan(MAX_BATCH, CONTEXT, target.scheduler_config.max_num_batched_tokens)


def make_plan(target: ProfileTarget, max_batch: int | None = None) -> Plan | None:
    """The plan with decode batches up to `max_batch` where the KV cache holds it, else the largest that
    fits: fewer requests, or one shorter request in a cache smaller than ROOM tokens. None: not even a
    request of one prompt token and REPEATS decode steps fits."""
    bm = target.block_manager
    n, context = min(MAX_BATCH if max_batch is None else max_batch, kv_batch(bm)), CONTEXT
    if n < 1:
        blocks = bm.num_blocks if bm.window_pool is None else min(bm.num_blocks, bm.window_pool.num_blocks - 1)
        n, context = 1, blocks * bm.block_size - REPEATS
        if context < 1:
            return None
    return _plan(n, context, target.scheduler_config.max_num_batched_tokens)


def limit(model: StepCostModel, target: ProfileTarget) -> StepCostModel:
    """The profile as this engine uses it: Eq. 1's Peak at most the decode micro-batch it can form
    (max_num_seqs over the stages, and what its KV cache holds)."""
    cfg, pp = target.scheduler_config, target.executor.num_stages
    peak = max(1, min(model.peak_batch, cfg.max_num_seqs // pp or 1, kv_batch(target.block_manager)))
    return dataclasses.replace(model, peak_batch=peak)


def profile_key(target: ProfileTarget, plan: Plan | None = None) -> dict:
    """Everything the measured points depend on: the plan, the model files and what runs them. Not the KV
    capacity, max_num_seqs or max_model_len: they change only the plan (keyed) or Peak (applied on use);
    stage receive buffers grow to any batch, so the token limits do not change what a step costs."""
    from tdpipe.model.cache import model_identity, runtime_key

    plan = plan or make_plan(target)
    return {"version": PROFILE_VERSION, "model": os.path.abspath(target.model_path),
            "model_files": model_identity(target.model_path), "dtype": str(target.dtype), "pp": target.pp,
            "partition": [list(p) for p in target.partition], "threads": list(target.stage_threads),
            "block_size": target.block_manager.block_size,
            "plan": dataclasses.asdict(plan) if plan else None, **runtime_key()}


def _run(target: ProfileTarget, seqs: list[Sequence], lens: list[int], prefill: bool) -> float:
    batch = Batch(-1, seqs, lens, is_prefill=prefill)
    step = batch.step_input()
    step.greedy_rows = [True] * len(seqs)
    t = target.executor.now()
    target.executor.submit(step)
    target.executor.collect()
    elapsed = target.executor.now() - t
    for s, n in zip(seqs, lens):
        s.num_computed_tokens += n
    return elapsed / target.executor.num_stages


def measure_plan(target: ProfileTarget, plan: Plan) -> StepCostModel:
    """Run `plan` on the engine's executor. peak_batch is the largest decode batch measured (not yet
    limited to the engine: see `limit`)."""
    bm = target.block_manager
    rng = random.Random(0)
    vocab = target.model_config.vocab_size
    extra = plan.room - plan.context
    seqs = [Sequence(target.new_seq_id(), "profile", [rng.randrange(vocab) for _ in range(plan.context)],
                     SamplingParams(max_tokens=extra), max_tokens=extra) for _ in range(plan.requests)]
    prefill: list[tuple[int, float]] = []
    decode: list[tuple[int, float]] = []
    try:
        for s in seqs:
            bm.allocate(s, plan.room)
        # untimed warm-up (first-step costs: allocator, kernels, transport); each prefill is timed once
        _run(target, seqs[:1], [plan.context], True)
        seqs[0].num_computed_tokens = 0
        done = 0
        for k in plan.prefill:
            group = seqs[done:done + k]
            prefill.append((k * plan.context, _run(target, group, [plan.context] * k, True)))
            done += k
        for b in plan.decode:
            best = float("inf")
            for _ in range(REPEATS):
                group = seqs[:b]
                for s in group:
                    s.output_token_ids.append(rng.randrange(vocab))
                best = min(best, _run(target, group, [1] * b, False))
            decode.append((b, best))
    finally:
        for s in seqs:
            if s.block_table:
                bm.free(s)
        target.executor.release([s.seq_id for s in seqs])
    if len(prefill) < 2:  # one request fits: add a point so the line has a slope
        prefill.append((0, 0.0))
    if len(decode) < 2:
        decode.append((0, 0.0))
    return StepCostModel.fit(decode, prefill, peak_batch=plan.requests)


def measure(target: ProfileTarget, max_batch: int | None = None) -> StepCostModel:
    """Profile decode batches up to `max_batch` (and max_num_seqs over the stages), limited to the engine.
    Uncached: the simulator's executor (steps cost nothing to time) is profiled this way up to 512, past
    where GPU decode turns compute-bound. With a cache too small for even one dummy request, the default
    costs with Peak 1."""
    cfg, pp = target.scheduler_config, target.executor.num_stages
    top = MAX_BATCH if max_batch is None else max_batch
    plan = make_plan(target, max(1, min(top, cfg.max_num_seqs // pp or 1)))
    if plan is None:
        log.warning("the KV cache (%d tokens) is too small to profile step costs; using defaults",
                    target.block_manager.num_blocks * target.block_manager.block_size)
        return limit(StepCostModel(peak_batch=1), target)
    return limit(measure_plan(target, plan), target)


def _pairs(v: Any, name: str) -> list[tuple[int, float]]:
    if not isinstance(v, list) or len(v) < 2:
        raise ValueError(f"points.{name} is not a list of at least two points")
    out = []
    for p in v:
        if (not isinstance(p, list) or len(p) != 2 or not isinstance(p[0], int) or isinstance(p[0], bool)
                or not isinstance(p[1], (int, float)) or not math.isfinite(p[1]) or p[1] < 0 or p[0] < 0):
            raise ValueError(f"points.{name} has a bad point {p!r}")
        out.append((p[0], float(p[1])))
    return out


def parse_profile(data: Any, key: dict, source: str) -> StepCostModel:
    """A cached profile back as a StepCostModel; ValueError saying what is wrong with it."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("key") != json.loads(json.dumps(key)):  # as JSON has it: tuples are lists
        raise ValueError("its key does not match this engine")
    vals = {}
    for f in ("d0", "d1", "p0", "p1"):
        v = data.get(f)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{f} is {v!r}, not a finite number >= 0")
        vals[f] = float(v)
    peak = data.get("peak_batch")
    if not isinstance(peak, int) or isinstance(peak, bool) or peak < 1:
        raise ValueError(f"peak_batch is {peak!r}, not an integer >= 1")
    pts = data.get("points")
    if not isinstance(pts, dict):
        raise ValueError("points is missing")
    points = {"decode": _pairs(pts.get("decode"), "decode"), "prefill": _pairs(pts.get("prefill"), "prefill")}
    if vals["d0"] + vals["d1"] <= 0:
        raise ValueError("decode costs nothing")  # Eq. 1 divides by it
    return StepCostModel(**vals, peak_batch=peak, source=source, points=points)


def _path(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"step-{digest}.json"


def _load(path: Path, key: dict, then: str = "measuring it again and overwriting it") -> StepCostModel | None:
    """The cached profile at path, or None: missing, or damaged (said on stderr with `then`)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("tdpipe: cannot read the step profile %s (%s); %s", path, e, then)
        return None
    try:
        return parse_profile(json.loads(text), key, str(path))
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        log.warning("tdpipe: step profile %s is damaged (%s); %s", path, e, then)
        return None


def _save(path: Path, model: StepCostModel, key: dict) -> None:
    """Write via a private temporary file and rename, so a reader never sees half a profile."""
    from tdpipe.model.cache import write_json

    try:
        write_json(path, {"d0": model.d0, "d1": model.d1, "p0": model.p0, "p1": model.p1,
                          "peak_batch": model.peak_batch, "points": model.points, "key": key})
    except OSError as e:
        log.warning("could not cache the step profile at %s: %s", path, e)


def load_or_measure(target: ProfileTarget, use_cache: bool = True) -> StepCostModel:
    """The engine's profile, limited to it. A KV cache too small for the standard plan uses the standard
    profile if one is cached (its points do not depend on the capacity), else measures the plan it can
    hold and caches it under that plan's key: the standard profile is never written by such a run."""
    plan = make_plan(target)
    if plan is None:
        return measure(target)
    standard = standard_plan(target)
    keys = [profile_key(target, standard)] if plan != standard else []
    keys.append(profile_key(target, plan))
    if use_cache:
        for key in keys:
            hit = _load(_path(key), key, "measuring it again and overwriting it" if key is keys[-1]
                        else "not using it")
            if hit is not None:
                return limit(hit, target)
    t = time.perf_counter()
    model = measure_plan(target, plan)
    log.info("step-cost profile (%.1f s): decode %.4f + %.5f*B s, prefill %.4f + %.6f*T s per stage",
             time.perf_counter() - t, model.d0, model.d1, model.p0, model.p1)
    if use_cache:
        _save(_path(keys[-1]), model, keys[-1])
    return limit(model, target)


__all__ = ["Plan", "ProfileTarget", "cache_dir", "kv_batch", "limit", "load_or_measure", "make_plan", "measure",
           "measure_plan", "parse_profile", "profile_key", "standard_plan"]
