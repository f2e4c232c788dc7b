"""Build a simulated engine (the real LLMEngine over a SimExecutor) and run a workload through it.

The engine, its Scheduler, BlockManager and predictor are the real ones; only the executor is simulated.
KV capacity comes from device memory minus the weights each device holds (per stage, the smallest wins,
as the stages share one page table), unless the caller fixes it.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tdpipe.config import ModelConfig
from tdpipe.engine_args import EngineArgs
from tdpipe.sim.cost import CostModel, kv_heads_per_device, model_bytes, stage_weight_bytes
from tdpipe.sim.hardware import Hardware

MODELS_DIR = Path(__file__).parent / "models"
PAPER_MODELS = {"13b": "llama-2-13b", "32b": "qwen2.5-32b", "70b": "llama-2-70b"}


def model_names() -> list[str]:
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def resolve_sim_model(spec: str | None) -> str:
    """A shipped config name (llama-2-13b, qwen2.5-32b, llama-2-70b; or 13b/32b/70b), a folder with
    config.json, a config.json file, or None for the bundled SmolLM2. Weights are never read."""
    if spec is None or spec == "bundled":
        from tdpipe.model.bundled import resolve_model

        return resolve_model(None)
    key = PAPER_MODELS.get(spec.lower(), spec.lower())
    if (MODELS_DIR / key / "config.json").is_file():
        return str(MODELS_DIR / key)
    path = Path(spec).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        return str(path.parent) if path.name == "config.json" else _config_folder(path)
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    raise ValueError(f"unknown model {spec!r}: expected one of {model_names()}, a folder with config.json or a "
                     "config .json file")


def sim_model_config(spec: str | None) -> tuple[str, dict[str, Any]]:
    """(folder, HF config dict) of a model spec as resolve_sim_model takes it."""
    from tdpipe.model.weights import load_hf_config

    path = resolve_sim_model(spec)
    return path, load_hf_config(path)


def _config_folder(path: Path) -> str:
    """A config file not named config.json: copied into a cache folder the engine can read."""
    import hashlib

    from tdpipe.model.cache import cache_dir

    data = path.read_bytes()
    out = cache_dir() / "sim-models" / hashlib.sha1(data).hexdigest()[:16]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_bytes(data)
    return str(out)


@dataclass
class SimConfig:
    hardware: Hardware
    num_devices: int = 1
    parallel: str = "pp"  # pp: one stage per device; tp: one stage over all devices (Megatron TP)
    model: str | None = None
    dtype_bytes: int = 2
    num_kv_blocks: int | None = None  # fixes the KV capacity (e.g. to match a real run)
    # otherwise a budget as CacheConfig takes it; None: from device memory (GPU rows), the engine's default
    # budget (CPU rows, whose memory is the host's)
    kv_cache_memory: int | float | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # LLM-style keywords (EngineArgs'); None: the default
    tensor_parallel: int | None = None  # a P x T layout: T devices per stage, P = num_devices / T (overrides
    # `parallel`, which then only names the extremes)

    def __post_init__(self) -> None:
        if self.parallel not in ("pp", "tp"):
            raise ValueError(f"parallel must be 'pp' or 'tp', got {self.parallel!r}")
        if not isinstance(self.num_devices, int) or self.num_devices < 1:
            raise ValueError(f"num_devices must be an integer >= 1, got {self.num_devices!r}")
        t = self.tensor_parallel
        if t is not None and (not isinstance(t, int) or t < 1 or self.num_devices % t):
            raise ValueError(f"tensor_parallel {t!r} must be an integer >= 1 dividing num_devices {self.num_devices}")

    @property
    def tp(self) -> int:
        if self.tensor_parallel is not None:
            return self.tensor_parallel
        return self.num_devices if self.parallel == "tp" else 1

    @property
    def pp(self) -> int:
        return self.num_devices // self.tp

    @property
    def layout(self) -> str:
        """P x T, as the runtime's `--pp P --tp T`."""
        return f"{self.pp}x{self.tp}"


class DoesNotFit(ValueError):
    """The model's weights leave no room for a KV cache of one max-length request."""


def kv_blocks_from_memory(mc: ModelConfig, hw: Hardware, partition: list[tuple[int, int]], tp: int,
                          block_size: int, dtype_bytes: int = 2) -> int:
    """Blocks every stage can hold: per device, usable memory minus its share of the stage's weights and the
    reserve, divided by the KV one token needs on that stage's layers (split over tp)."""
    per_layer = 2 * kv_heads_per_device(mc, tp) * mc.head_dim * dtype_bytes  # one device's share
    tokens = []
    n = len(partition)
    for k, (a, b) in enumerate(partition):
        weights = stage_weight_bytes(mc, b - a, k == 0, k == n - 1, dtype_bytes) / tp
        free = hw.memory * hw.mem_util - weights - hw.reserve
        if free <= 0:
            need = (model_bytes(mc, dtype_bytes) / (n * tp) + hw.reserve) / (hw.mem_util * 1e9)
            raise DoesNotFit(f"the weights do not fit: stage {k} needs {weights / 1e9:.1f} GB of weights per device, "
                             f"{hw.name} has {hw.memory * hw.mem_util / 1e9:.1f} GB usable "
                             f"(about {need:.0f} GB per device needed over {n * tp} devices)")
        tokens.append(int(free // (per_layer * (b - a))))
    return min(tokens) // block_size


def build_engine(cfg: SimConfig, executor_cls: type | None = None):
    """The real LLMEngine, built with a SimExecutor (or `executor_cls`, a subclass of it: the PD decode side's,
    sim/pd.py); raises DoesNotFit when no KV cache fits."""
    from tdpipe.core.engine import LLMEngine
    from tdpipe.sim.executor import SimExecutor
    from tdpipe.worker.partition import resolve_partition

    kw = {k: v for k, v in cfg.engine.items() if v is not None}  # None: the default
    # each of vLLM's virtual engines (one per stage) had its own max_num_seqs
    kw.setdefault("max_num_seqs", EngineArgs.max_num_seqs * cfg.pp)
    path, hf = sim_model_config(cfg.model)
    # KV bytes per token follow dtype_bytes, not the host CPU's dtype
    args = EngineArgs.from_kwargs(**kw, model=path, dtype="bfloat16" if cfg.dtype_bytes == 2 else "float32",
                                  pipeline_parallel_size=cfg.pp, kv_cache_memory=cfg.kv_cache_memory,
                                  num_kv_blocks=cfg.num_kv_blocks, collect_trace=True)
    mc = ModelConfig.from_hf(hf)
    if args.num_kv_blocks is None and cfg.kv_cache_memory is None and not cfg.hardware.threads:
        partition = resolve_partition(mc, cfg.pp, args.layer_partition)
        args.num_kv_blocks = kv_blocks_from_memory(mc, cfg.hardware, partition, cfg.tp, args.block_size,
                                                   cfg.dtype_bytes)
        if args.num_kv_blocks < 1:
            raise DoesNotFit(f"no KV block fits beside the weights of {Path(path).name} on {cfg.num_devices}x "
                             f"{cfg.hardware.name}")
    engine_cfg = args.create_engine_config()

    def factory(engine) -> SimExecutor:
        cost = CostModel(engine.model_config, cfg.hardware, engine.partition, cfg.tp, cfg.dtype_bytes)
        return (executor_cls or SimExecutor)(cost, measured_engine=cfg.hardware.measured_engine)

    return LLMEngine(engine_cfg, executor_factory=factory)


def simulate(cfg: SimConfig, reqs: list, trace_path: str | None = None, kv_points: int = 400) -> dict[str, Any]:
    """Run the requests (bench.workload.BenchRequest: token ids + forced output length) to completion;
    returns throughput, bubble ratios, KV usage over time and the engine's counters."""
    from tdpipe.core.scheduler.registry import get_policy
    from tdpipe.sampling.params import SamplingParams
    from tdpipe.viz.timeline import summarize

    wall0 = time.perf_counter()
    engine = build_engine(cfg)
    setup = time.perf_counter() - wall0
    sched = engine.scheduler
    max_len = sched.config.max_model_len
    for k, r in enumerate(reqs):
        if r.input_len + r.output_len > max_len:
            raise ValueError(f"request {k}: {r.input_len} + {r.output_len} tokens exceed max_model_len {max_len}")
    spec = get_policy(sched.config.policy)
    before = spec.read_stats(sched)
    engine.reset_trace()
    t0 = engine.clock()
    for k, r in enumerate(reqs):
        engine.add_request(str(k), r.prompt_token_ids,
                           SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len))
    finished = 0
    while engine.has_unfinished():
        finished += sum(d.finished for d in engine.step())
    elapsed = engine.clock() - t0
    trace = engine.trace()
    hw = cfg.hardware
    trace["machine"] = f"simulated: {cfg.num_devices}x {hw.name} (pp {cfg.pp} x tp {cfg.tp})"
    summary = summarize(trace)
    in_tok = sum(r.input_len for r in reqs)
    out_tok = sum(r.output_len for r in reqs)
    kv = trace["kv"]
    stride = max(1, len(kv) // kv_points)
    st = engine.stats
    res = {
        "simulated": True,
        "hardware": hw.to_json(),
        "num_devices": cfg.num_devices, "parallel": cfg.layout, "pp": cfg.pp, "tp": cfg.tp,
        "model": Path(engine.model_path).name,
        "policy": sched.config.policy,
        "num_requests": len(reqs), "finished": finished,
        "elapsed_s": elapsed,
        "requests_per_s": len(reqs) / elapsed,
        "output_tokens_per_s": out_tok / elapsed,
        "total_tokens_per_s": (in_tok + out_tok) / elapsed,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "bubble_ratio": summary["bubble_ratio"],
        **_breakdown(trace),
        "bubble_ratio_per_stage": summary["bubble_ratio_per_stage"],
        "decode_bubble_ratio": summary["decode_bubble_ratio"],
        **{k: v - before[k] for k, v in spec.read_stats(sched).items()},  # the policy's counters (registry.py)
        "prefill_steps": st.prefill_steps, "decode_steps": st.decode_steps, "mixed_steps": st.mixed_steps,
        "kv_blocks": engine.block_manager.num_blocks,
        "kv_capacity_tokens": engine.block_manager.num_blocks * engine.block_manager.block_size,
        "kv_usage_mean": _time_mean(kv),
        "kv_usage": kv[::stride],
        "layer_partition": [b - a for a, b in engine.partition],
        "max_num_seqs": sched.config.max_num_seqs,
        "max_num_batched_tokens": sched.config.max_num_batched_tokens,
        "step_costs": (asdict(sched.costs) | {"points": None}) if spec.wants_step_costs(sched.config) else None,
        "sim_wall_s": time.perf_counter() - wall0, "sim_setup_s": setup,
    }
    if trace_path:
        import json

        with open(trace_path, "w") as f:
            f.write(json.dumps(trace))  # the same text as json.dump, 3x sooner (C encoder: one shot, no indent)
    engine.shutdown()
    return res


def _breakdown(trace: dict[str, Any]) -> dict[str, Any]:
    """Charged time per stage split into compute and all-reduce (TD-Pipe Fig. 6), from the trace's events."""
    busy = [sum(e["end"] - e["start"] for e in st["events"]) for st in trace["stages"]]
    ar = [sum(e.get("allreduce", 0.0) for e in st["events"]) for st in trace["stages"]]
    return {"busy_s_per_stage": busy, "allreduce_s_per_stage": ar,
            "compute_s_per_stage": [b - a for b, a in zip(busy, ar)],
            "allreduce_share": sum(ar) / sum(busy) if sum(busy) else 0.0}


def _time_mean(kv: list[list[float]]) -> float:
    """Time-weighted mean KV usage over the run."""
    if len(kv) < 2 or kv[-1][0] <= kv[0][0]:
        return kv[-1][1] if kv else 0.0
    area = sum((t1 - t0) * u for (t0, u), (t1, _) in zip(kv, kv[1:]))
    return area / (kv[-1][0] - kv[0][0])


__all__ = ["DoesNotFit", "PAPER_MODELS", "SimConfig", "build_engine", "kv_blocks_from_memory", "model_names",
           "resolve_sim_model", "sim_model_config", "simulate"]
