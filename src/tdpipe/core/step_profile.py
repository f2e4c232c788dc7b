"""Start-up profile of step costs on the actual executor, for TD-Pipe's intensity comparison (§3.5).

Eq. 1 needs the decode time per batch size and Eq. 2 the prefill time per token count. Both are measured
here by running dummy requests through the engine's own executor (all stages, real KV cache, real
transport) with nothing else in flight, then fitted with lines (`StepCostModel.fit`). The time of one
micro-batch is its latency through the pipeline divided by the number of stages: the per-stage time the
scheduler reasons about. The result is cached per model, dtype, partition, threads and machine, so only the
first start pays the few seconds.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tdpipe.config import cpu_name
from tdpipe.core.batch import Batch, StepInput
from tdpipe.core.scheduler.td_pipe import StepCostModel
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence

if TYPE_CHECKING:
    from tdpipe.core.engine import LLMEngine

log = logging.getLogger("tdpipe")
PROFILE_VERSION = 2  # 2: bf16 linears packed for oneDNN (model/packed_linear.py)
CONTEXT = 64  # prompt tokens per dummy request (decode attention reads this much KV)
REPEATS = 3


def cache_dir() -> Path:
    """$TDPIPE_CACHE/profiles (default ~/.cache/tdpipe/profiles), beside the converted models and kernels."""
    from tdpipe.model.bundled import cache_dir as root

    return root() / "profiles"


def profile_key(engine: "LLMEngine") -> dict:
    import torch

    from tdpipe.model.packed_linear import packing_available

    st = os.stat(engine.model_path)
    return {"version": PROFILE_VERSION, "model": os.path.abspath(engine.model_path), "model_mtime": st.st_mtime,
            "dtype": str(engine.dtype), "pp": engine.pp, "partition": [list(p) for p in engine.partition],
            "threads": engine.stage_threads, "max_num_seqs": engine.scheduler.config.max_num_seqs,
            "block_size": engine.block_manager.block_size, "cpu": cpu_name(), "cores": os.cpu_count(),
            "torch": torch.__version__, "packed_linear": packing_available()}


def _run(engine: "LLMEngine", seqs: list[Sequence], lens: list[int], prefill: bool) -> float:
    batch = Batch(-1, seqs, lens, is_prefill=prefill)
    step = StepInput.from_batch(batch)
    step.greedy_rows = [True] * len(seqs)
    t = engine.clock()
    engine.executor.submit(step)
    engine.executor.collect()
    elapsed = engine.clock() - t
    for s, n in zip(seqs, lens):
        s.num_computed_tokens += n
    return elapsed / engine.executor.num_stages


def measure(engine: "LLMEngine", max_batch: int = 128) -> StepCostModel:
    """Prefill dummy requests in growing batches, then decode them at growing batch sizes up to `max_batch`
    (Peak's "sufficiently large batch", Eq. 1: 128 keeps the start-up short on a CPU; the simulator, whose
    steps cost nothing to time, goes to 512, past where GPU decode turns compute-bound)."""
    bm, cfg = engine.block_manager, engine.scheduler.config
    pp = engine.executor.num_stages
    room = CONTEXT + 2 * REPEATS * 8 + 1
    cap = max(1, min(cfg.max_num_seqs // pp or 1, max_batch, (bm.num_blocks - 1) // bm.blocks_needed(room)))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    seqs = [Sequence(next(engine._seq_ids), "profile", [rng.randrange(vocab) for _ in range(CONTEXT)],
                     SamplingParams(max_tokens=room - CONTEXT), max_tokens=room - CONTEXT) for _ in range(cap)]
    prefill: list[tuple[int, float]] = []
    decode: list[tuple[int, float]] = []
    try:
        for s in seqs:
            bm.allocate(s, room)
        done, k = 0, 1
        per_batch = max(1, cfg.max_num_batched_tokens // CONTEXT)
        while done < cap:  # prefill batches of 1, 2, 4, ... requests
            group = seqs[done:done + min(k, per_batch)]
            prefill.append((len(group) * CONTEXT, _run(engine, group, [CONTEXT] * len(group), True)))
            done += len(group)
            k *= 2
        sizes = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, cap) if b <= cap})
        for b in sizes:
            best = float("inf")
            for _ in range(REPEATS):
                group = seqs[:b]
                for s in group:
                    s.output_token_ids.append(rng.randrange(vocab))
                best = min(best, _run(engine, group, [1] * b, False))
            decode.append((b, best))
    finally:
        for s in seqs:
            bm.free(s)
        engine.executor.release([s.seq_id for s in seqs])
    if len(prefill) < 2:  # one request fits: add a point so the line has a slope
        prefill.append((0, 0.0))
    if len(decode) < 2:
        decode.append((0, 0.0))
    return StepCostModel.fit(decode, prefill, peak_batch=cap)


def load_or_measure(engine: "LLMEngine", use_cache: bool = True) -> StepCostModel:
    key = profile_key(engine)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"step-{digest}.json"
    if use_cache and path.exists():
        try:
            data = json.loads(path.read_text())
            return StepCostModel(**{k: data[k] for k in ("d0", "d1", "p0", "p1", "peak_batch")}, source=str(path),
                                 points=data.get("points", {}))
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("ignoring unreadable step profile %s", path)
    t = time.perf_counter()
    model = measure(engine)
    log.info("step-cost profile (%.1f s): decode %.4f + %.5f*B s, prefill %.4f + %.6f*T s per stage",
             time.perf_counter() - t, model.d0, model.d1, model.p0, model.p1)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = {"d0": model.d0, "d1": model.d1, "p0": model.p0, "p1": model.p1, "peak_batch": model.peak_batch,
                    "points": model.points, "key": key}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)
        except OSError as e:
            log.warning("could not cache the step profile at %s: %s", path, e)
    return model


__all__ = ["cache_dir", "load_or_measure", "measure", "profile_key"]
