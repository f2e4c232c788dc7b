"""Calibrate the roofline cost model to this CPU, so simulated runs can be set beside real ones.

For each thread count a stage may get (all cores at pp = 1, cores / 2 at pp = 2, ...):
  1. measure the peaks the roofline is relative to: torch's square bf16 matmul (bench/peak.py) and the
     memory read bandwidth (a sum over a buffer far larger than the caches);
  2. time the real model (the in-process executor: input preparation, all layers, lm_head, argmax) on
     decode micro-batches of 1..128 sequences at two context lengths and on prefills of 16..2048 tokens,
     with every core busy: a device of n threads is timed in cores / n processes at once, as the stages of
     a pipeline run (they share memory bandwidth, caches and clocks; alone, a 1-thread stage timed 10-17%
     faster than it runs beside another);
  3. fit the cost model's free parameters to those times: the achieved fractions flops_eff, bw_eff and
     attn_eff by grid search, and for each candidate layer_overhead and step_overhead (>= 0) by weighted
     least squares on relative error.
  4. for a thread count that leaves room for a pipeline (n < cores), run a short real pipeline of cores / n
     stages (64 ShareGPT-like requests, seed 1: not the fidelity workload) with its trace, and set
     `slowdown` = the stages' decode compute time / what the fitted model predicts for the same
     micro-batches. On 2 cores it is well above 1: each stage shares its core with its prep and sender
     threads and with the engine process, none of which the isolated timing sees.
The result is a hardware row per thread count (`threads`), cached per CPU, model and torch version.
The engine's own time is not modelled on the CPU: the simulator charges what the engine's Python really
takes between executor calls (`measured_engine`), on this machine, for the same scheduling code.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tdpipe.sim.cost import CostModel, StepShape
from tdpipe.sim.device import GB, Hardware

log = logging.getLogger("tdpipe")
CALIBRATION_VERSION = 5  # 5: bf16 linears packed for oneDNN (model/packed_linear.py)
DECODE_BATCHES = (1, 8, 32, 64, 128)
DECODE_CONTEXTS = (128, 512)
PREFILLS = ((1, 16), (1, 64), (1, 256), (1, 1024), (4, 256), (8, 256), (1, 2048))  # (prompts, tokens each)
REPEATS = 5  # the median: real runs see typical step times, not the best case
# gloo point-to-point on loopback (measured on the development VM: ~0.2 ms); bandwidth assumed
CPU_LINK_LATENCY = 0.2e-3
CPU_LINK_BW = 2 * GB


def cache_key(model_path: str, threads: list[int]) -> dict:
    """What the calibration's timings depend on: the model files, the thread counts, the CPU, torch and
    whether the C++ kernels and packed linears run."""
    from tdpipe.model.cache import model_identity, runtime_key

    return {"v": CALIBRATION_VERSION, "model": os.path.abspath(model_path), "threads": sorted(threads),
            "model_files": model_identity(model_path), **runtime_key()}


def cache_path(model_path: str, threads: list[int]) -> Path:
    from tdpipe.model.cache import cache_dir

    key = cache_key(model_path, threads)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "sim" / f"cpu-{digest}.json"


def default_thread_counts() -> list[int]:
    from tdpipe.config import default_threads

    cores = default_threads()
    return sorted({max(1, cores // k) for k in (1, 2)})


def measure_bandwidth(threads: int, nbytes: int = 1 << 30) -> float:
    """Bytes/s reading a buffer much larger than the caches (best of five sums)."""
    import torch

    own = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        x.sum()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return nbytes / best
    finally:
        torch.set_num_threads(own)


def measure_steps(threads: int, model: str | None = None) -> tuple[Any, list[dict]]:
    """Time the real model on the calibration shapes; returns (model config, [{query_lens, seq_lens, s}])."""
    from tdpipe.config import CacheConfig, EngineConfig, SchedulerConfig
    from tdpipe.core.batch import Batch
    from tdpipe.core.engine import LLMEngine
    from tdpipe.sampling.params import SamplingParams
    from tdpipe.sequence import Sequence

    most = max(DECODE_BATCHES) * (max(DECODE_CONTEXTS) + 1) + max(n * t for n, t in PREFILLS)
    cfg = EngineConfig(model=model, num_threads=threads,
                       cache=CacheConfig(num_blocks=most // 16 + 2 * max(DECODE_BATCHES) + 16),
                       scheduler=SchedulerConfig(max_model_len=4096))
    engine = LLMEngine(cfg)
    bm, ex, vocab = engine.block_manager, engine.executor, engine.model_config.vocab_size
    rng = random.Random(0)

    def seqs(n: int, tokens: int, decode: bool) -> list[Sequence]:
        out = []
        for _ in range(n):
            s = Sequence(next(engine._seq_ids), "calibrate", [rng.randrange(100, vocab) for _ in range(tokens)],
                         SamplingParams(max_tokens=2), max_tokens=2)
            if decode:  # a cached prefix of `tokens`, one new token: KV content does not change the time
                s.output_token_ids.append(rng.randrange(100, vocab))
                s.num_computed_tokens = tokens
            bm.allocate(s)
            out.append(s)
        return out

    def timed(group: list[Sequence], lens: list[int], prefill: bool) -> dict:
        step = Batch(-1, group, lens, is_prefill=prefill).step_input()
        step.greedy_rows = [True] * len(group)
        times = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            ex.submit(step)
            ex.collect()
            times.append(time.perf_counter() - t)
        for s in group:
            bm.free(s)
        return {"query_lens": step.query_lens, "seq_lens": step.seq_lens, "s": sorted(times)[REPEATS // 2]}

    points = []
    try:
        timed(seqs(2, 32, False), [32, 32], True)  # warm-up: kernels, allocator
        for n, t in PREFILLS:
            points.append(timed(seqs(n, t, False), [t] * n, True))
        for c in DECODE_CONTEXTS:
            for b in DECODE_BATCHES:
                points.append(timed(seqs(b, c, True), [1] * b, False))
    finally:
        mc = engine.model_config
        engine.shutdown()
    return mc, points


def measure_concurrently(threads: int, model: str | None, copies: int) -> tuple[Any, list[dict]]:
    """measure_steps in `copies` processes at once; each shape's time is the mean over the copies."""
    if copies <= 1:
        return measure_steps(threads, model)
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(copies) as pool:
        outs = pool.starmap(measure_steps, [(threads, model)] * copies)
    points = [dict(p, s=sum(o[1][i]["s"] for o in outs) / copies, copies=[o[1][i]["s"] for o in outs])
              for i, p in enumerate(outs[0][1])]
    return outs[0][0], points


def pipeline_slowdown(threads: int, row: Hardware, model: str | None = None, requests: int = 64) -> dict:
    """Real stage decode time in a running pipeline of cores / threads stages over the fitted prediction."""
    from tdpipe import LLM, SamplingParams
    from tdpipe.bench import workload as wl
    from tdpipe.config import default_threads

    pp = max(2, default_threads() // threads)
    with LLM(model, pipeline_parallel_size=pp, threads_per_stage=threads, kv_cache_memory=256 << 20,
             collect_trace=True) as llm:
        mc = llm.engine.model_config
        reqs = wl.sharegpt_like(requests, mc.vocab_size, 1, 2048)
        llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs],
                     [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in reqs], use_tqdm=False)
        trace, partition = llm.trace(), llm.engine.partition
    cm = CostModel(mc, replace(row, slowdown=1.0), partition)
    real = [0.0] * pp
    pred = [0.0] * pp
    for k, st in enumerate(trace["stages"]):
        for e in st["events"]:
            d = e.get("decode_seqs", 0)
            if e.get("prefill_tokens", 0) or not d:
                continue  # prefills: the per-sequence split behind the attention cost is not in the trace
            shape = StepShape(d, d, float(e["context_tokens"]), e["context_tokens"])
            real[k] += e["end"] - e["start"]
            pred[k] += cm.stage_times(shape)[k]
    return {"slowdown": sum(real) / sum(pred), "per_stage": [r / p for r, p in zip(real, pred)], "pp": pp,
            "requests": requests, "partition": [b - a for a, b in partition]}


def _grid(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def fit(mc: Any, base: Hardware, points: list[dict]) -> tuple[Hardware, dict]:
    """Grid search over (flops_eff, bw_eff, attn_eff); layer_overhead and step_overhead by non-negative
    weighted least squares for each. Returns the best row and its relative errors per point."""
    shapes = [StepShape.of(p["query_lens"], p["seq_lens"]) for p in points]
    ts = [p["s"] for p in points]
    w = [1.0 / (t * t) for t in ts]  # minimise relative error
    L = mc.num_layers
    partition = [(0, L)]
    best: tuple[float, Hardware] | None = None
    zero = replace(base, layer_overhead=0.0, step_overhead=0.0)
    for fe in _grid(0.05, 1.0, 24):
        for be in _grid(0.1, 1.0, 10):
            for fa in _grid(0.005, 1.0, 16):
                cm = CostModel(mc, replace(zero, flops_eff=fe, bw_eff=be, attn_eff=fa), partition)
                base_t = [cm.stage_times(s)[0] for s in shapes]
                lo, so = _nnls2([float(L)] * len(ts), [1.0] * len(ts), [t - b for t, b in zip(ts, base_t)], w)
                err = sum(wi * (t - b - L * lo - so) ** 2 for wi, t, b in zip(w, ts, base_t))
                if best is None or err < best[0]:
                    best = (err, replace(base, flops_eff=fe, bw_eff=be, attn_eff=fa, layer_overhead=lo,
                                         step_overhead=so))
    hw = best[1]
    cm = CostModel(mc, hw, partition)
    pred = [cm.stage_times(s)[0] for s in shapes]
    rel = [(p - t) / t for p, t in zip(pred, ts)]
    return hw, {"relative_errors": rel, "rms_relative_error": (sum(r * r for r in rel) / len(rel)) ** 0.5,
                "predicted_s": pred}


def _nnls2(x1: list[float], x2: list[float], y: list[float], w: list[float]) -> tuple[float, float]:
    """argmin over a, b >= 0 of sum w (y - a x1 - b x2)^2 (two unknowns: the corners are enough)."""
    s11 = sum(wi * a * a for wi, a in zip(w, x1))
    s22 = sum(wi * b * b for wi, b in zip(w, x2))
    s12 = sum(wi * a * b for wi, a, b in zip(w, x1, x2))
    s1y = sum(wi * a * v for wi, a, v in zip(w, x1, y))
    s2y = sum(wi * b * v for wi, b, v in zip(w, x2, y))
    det = s11 * s22 - s12 * s12
    if det > 1e-30:
        a = (s1y * s22 - s2y * s12) / det
        b = (s2y * s11 - s1y * s12) / det
        if a >= 0 and b >= 0:
            return a, b

    def sse(a: float, b: float) -> float:
        return sum(wi * (v - a * p - b * q) ** 2 for wi, v, p, q in zip(w, y, x1, x2))

    cands = [(0.0, 0.0), (max(0.0, s1y / s11) if s11 else 0.0, 0.0), (0.0, max(0.0, s2y / s22) if s22 else 0.0)]
    return min(cands, key=lambda c: sse(*c))


def calibrate(threads: list[int] | None = None, model: str | None = None) -> dict:
    """Measure and fit one hardware row per thread count; returns the calibration document."""
    import torch

    from tdpipe.bench.peak import measure_matmul_peak
    from tdpipe.config import available_memory, cpu_name, cpu_supports_bf16, default_threads
    from tdpipe.model.bundled import resolve_model

    threads = threads or default_thread_counts()
    dtype = torch.bfloat16 if cpu_supports_bf16() else torch.float32
    devices, detail = {}, {}
    for n in threads:
        t0 = time.perf_counter()
        own = torch.get_num_threads()
        torch.set_num_threads(n)
        peak = measure_matmul_peak(dtype) * 1e9
        torch.set_num_threads(own)
        bw = measure_bandwidth(n)
        copies = max(1, default_threads() // n)
        mc, points = measure_concurrently(n, model, copies)
        base = Hardware(f"cpu-{n}t", peak, bw, float(available_memory()), CPU_LINK_BW, CPU_LINK_BW, link_latency=CPU_LINK_LATENCY,
                        allreduce_latency=CPU_LINK_LATENCY, engine_step=0.0, engine_row=0.0, mem_util=1.0,
                        reserve=0.0, threads=n, measured_engine=True,
                        source=f"measured on {cpu_name()} with {n} thread(s): matmul peak, memory read "
                               "bandwidth; efficiencies and overheads fitted to timed steps of the real model")
        hw, err = fit(mc, base, points)
        if copies > 1:
            err["pipeline"] = pipeline_slowdown(n, hw, model)
            hw = replace(hw, slowdown=err["pipeline"]["slowdown"])
        devices[str(n)] = hw.to_json()
        detail[str(n)] = {"points": points, "concurrent_copies": copies, **err, "seconds": time.perf_counter() - t0}
        log.info("calibrated %d thread(s): peak %.0f GFLOP/s, %.1f GB/s, fe %.2f be %.2f fa %.3f, layer %.0f us, "
                 "step %.2f ms, rms error %.1f%%, in-pipeline slowdown %.2f", n, peak / 1e9, bw / 1e9, hw.flops_eff, hw.bw_eff, hw.attn_eff,
                 hw.layer_overhead * 1e6, hw.step_overhead * 1e3, 100 * err["rms_relative_error"], hw.slowdown)
    return {"version": CALIBRATION_VERSION, "model": resolve_model(model), "cpu": cpu_name(),
            "dtype": str(dtype).replace("torch.", ""), "devices": devices, "fit": detail}


def pick_threads(doc: dict, threads: int | None) -> Hardware:
    """The calibration row for `threads` per device (default: the most threads calibrated)."""
    rows = doc.get("devices") or {}
    if not rows:
        raise ValueError("calibration file has no 'devices'")
    key = str(threads) if threads is not None else max(rows, key=int)
    if key not in rows:
        raise ValueError(f"no calibration for {threads} thread(s) per device; calibrated: {sorted(rows, key=int)}")
    return Hardware.from_json(rows[key])


def cpu_hardware(threads: int | None = None, model: str | None = None, recalibrate: bool = False) -> Hardware:
    """This machine's calibrated row, measured on first use (about a minute per thread count) and cached."""
    from tdpipe.model.bundled import resolve_model

    counts = default_thread_counts()
    if threads is not None and threads not in counts:
        counts = sorted(set(counts) | {threads})
    model_path = resolve_model(model)
    path = cache_path(model_path, counts)
    key = json.loads(json.dumps(cache_key(model_path, counts)))  # as JSON has it
    if path.exists() and not recalibrate:
        try:
            doc = json.loads(path.read_text())
            if not isinstance(doc, dict) or doc.get("key") != key:
                raise ValueError("its key does not match")
            return pick_threads(doc, threads)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("tdpipe: calibration %s is damaged (%s: %s); calibrating again", path,
                        type(e).__name__, e)
    from tdpipe.model.cache import write_json

    doc = calibrate(counts, model) | {"key": key}
    try:
        write_json(path, doc)  # renamed into place: never half a file
        log.info("CPU calibration cached at %s", path)
    except OSError as e:
        log.warning("could not cache the CPU calibration at %s: %s", path, e)
    return pick_threads(doc, threads)


__all__ = ["calibrate", "cache_key", "cache_path", "cpu_hardware", "fit", "measure_bandwidth", "measure_steps",
           "pick_threads"]
