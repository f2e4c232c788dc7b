"""`tdpipe gpu-check`: the GPU path validated in one command, the first time a GPU is available.

Steps, in this order (each in a fresh process of its own, with a time limit, so a crash, a hang or the GPU
memory of one step cannot spoil the next; the JSON is rewritten after every step, so a run stopped at its
limit still leaves what it did):
  environment         GPU, driver, memory, torch / CUDA / triton / transformers versions; a bf16 GEMM's
                      TFLOP/s and a device-to-device copy's bandwidth (what `gpu-check calibrate` uses)
  parity              greedy parity with transformers on the bundled model: float32 identical, bfloat16
                      identical or the first divergence a near-tie (bench/parity.py), at pp = 1 and pp = 2
                      (both stages on the one GPU)
  tests               pytest tests/gpu (collected only where CUDA is: tests/conftest.py)
  throughput_bundled  256 x (128 in / 128 out) on the bundled model: the engine, then transformers' batched
                      generate on the same prompts; target >= 10x
  throughput_8b       the same on a randomly initialised Llama-3-8B in bf16 (weights drawn here, never
                      downloaded), and the decode roofline at batch 256 (bench/roofline.py); target >= 50%
Exit status: 0 when every step passed, 1 when one failed, 2 when there is no CUDA device (one line). The
targets are verdicts in the JSON and the summary, not the exit status.

--dry-run runs the same steps on the CPU at tiny sizes (a tiny random Llama for both models), so the plumbing
(step order, processes, JSON, parity comparison, roofline arithmetic) is tested without a GPU
(tests/unit/test_gpu_check.py). Nothing of this module has run on a GPU yet (docs/gpu.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

SCHEMA = "tdpipe-gpu-check/1"
TARGET_VS_TRANSFORMERS = 10.0  # the bundled model, 256 x (128 in / 128 out)
TARGET_ROOFLINE = 0.5  # decode at batch 256 on the 8B config, of the datasheet memory bandwidth
BUDGET_S = 540  # the whole check: under ten minutes on one H100 with the wheels installed and the JSON written
REPO = Path(__file__).resolve().parents[3]  # src/tdpipe/bench/gpu_check.py -> the checkout
MODELS_ROOT: Path | None = None  # where random-weight models are drawn (None: the tdpipe cache); tests redirect it

# the dry run's stand-in for both models: 2 layers, GQA 4/2, a vocabulary just over the byte-level alphabet
TINY_LLAMA = {"_source": "tdpipe gpu-check --dry-run: a tiny Llama (random weights)",
              "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "head_dim": 16,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


@dataclass(frozen=True)
class Sizes:
    """How big each step is: `full` on a GPU, `tiny` for the CPU dry run."""

    name: str
    parity_prompts: int
    parity_tokens: int
    parity_cases: tuple[tuple[str, int], ...]  # (dtype, pp)
    num_prompts: int
    input_len: int
    output_len: int
    small_model: str  # "bundled" or "tiny"
    large_model: str  # a shipped simulator config (sim/models) or "tiny"
    gemm_n: int
    copy_bytes: int
    parity_kv_bytes: int  # KV budget of the parity engines (small: the transformers references share the GPU)
    step_timeout_s: dict[str, int]


FULL = Sizes("full", 8, 32, (("float32", 1), ("bfloat16", 1), ("float32", 2), ("bfloat16", 2)), 256, 128, 128,
             "bundled", "llama-3-8b", 8192, 1 << 31, 1 << 30,
             {"environment": 90, "parity": 240, "tests": 180, "engine": 300, "hf": 180})
TINY = Sizes("tiny", 2, 4, (("float32", 1), ("bfloat16", 1)), 4, 8, 4, "tiny", "tiny", 64, 1 << 20, 8 << 20,
             {"environment": 60, "parity": 120, "tests": 120, "engine": 120, "hf": 120})
SIZES = {s.name: s for s in (FULL, TINY)}


# -- models ------------------------------------------------------------------------------------------------
def model_config(spec: str) -> dict[str, Any]:
    """The HF config of a model spec: "tiny", or a config shipped with the simulator (llama-3-8b,
    smollm2-135m: src/tdpipe/sim/models/NAME/config.json, shape fields only)."""
    if spec == "tiny":
        return dict(TINY_LLAMA)
    from importlib import resources

    f = resources.files("tdpipe").joinpath("sim", "models", spec, "config.json")
    if not f.is_file():
        raise ValueError(f"no shipped model config {spec!r}")
    return json.loads(f.read_text())


def model_folder(spec: str, device: str = "cpu") -> tuple[str, str]:
    """(local folder, what it is). "bundled" is the bundled SmolLM2; where its package did not travel, random
    weights of its config stand in (same shapes, so the same throughput; the JSON says so). Random weights
    are drawn on `device` (on a GPU in seconds, where the CPU's one-thread generator takes minutes for 8B)."""
    from tdpipe.model.random_model import random_model_folder

    if spec == "bundled":
        from tdpipe.model.bundled import BUNDLED_MODEL, bundled_model_path

        try:
            return bundled_model_path(), f"bundled {BUNDLED_MODEL}"
        except FileNotFoundError as e:
            return (random_model_folder(model_config("smollm2-135m"), root=MODELS_ROOT, device=device),
                    f"random weights of {BUNDLED_MODEL}'s config (the bundled model is not installed: {e})")
    cfg = model_config(spec)
    return (random_model_folder(cfg, root=MODELS_ROOT, device=device),
            f"random weights of {cfg.get('_source', spec)}")


# -- jobs: each runs in a process of its own and returns a JSON-able dict ------------------------------------
def job_environment(sizes: Sizes, device: str) -> dict[str, Any]:
    from tdpipe.bench.gpu_probe import copy_bandwidth, environment, matmul_tflops

    env = environment(device)
    env["matmul_n"] = sizes.gemm_n
    env["matmul_bf16_tflops"] = matmul_tflops(device, sizes.gemm_n)
    env["copy_bytes"] = sizes.copy_bytes
    env["copy_bytes_per_s"] = copy_bandwidth(device, sizes.copy_bytes)
    return {"status": "passed", **env}


def job_parity(sizes: Sizes, device: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from tdpipe import LLM, SamplingParams
    from tdpipe.bench.parity import PROMPTS, compare, hf_greedy, hf_logits_fn
    from tdpipe.tokenizer import load_tokenizer

    path, what = model_folder(sizes.small_model)
    tok = load_tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS[:sizes.parity_prompts]]
    n = sizes.parity_tokens
    dtypes = sorted({d for d, _ in sizes.parity_cases} | {"float32"})
    hf = {d: AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, d)).to(device).eval() for d in dtypes}
    refs = {d: hf_greedy(hf[d], prompts, n) for d in dtypes}
    tie = hf_logits_fn(hf["float32"])
    cases = []
    for dtype, pp in sizes.parity_cases:
        t = time.perf_counter()
        with LLM(path, dtype=dtype, device=device, pipeline_parallel_size=pp,
                 kv_cache_memory=sizes.parity_kv_bytes) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        engine = [list(o.outputs[0].token_ids) for o in outs]
        res = compare(prompts, engine, refs[dtype], exact=dtype == "float32", ref_logits=hf_logits_fn(hf[dtype]),
                      tie_logits=tie)
        cases.append({"dtype": dtype, "pp": pp, "seconds": time.perf_counter() - t, **res})
    return {"status": "passed" if all(c["passed"] for c in cases) else "failed", "model": what,
            "tokens_per_prompt": n, "cases": cases}


def job_tests(sizes: Sizes, device: str) -> dict[str, Any]:
    """pytest tests/gpu in a child process; counts and failures from its JUnit XML."""
    folder = REPO / "tests" / "gpu"
    if not folder.is_dir():
        return {"status": "error", "error": f"{folder} not found: run gpu-check from a checkout"}
    with tempfile.TemporaryDirectory() as d:
        xml = Path(d) / "junit.xml"
        # -o addopts=: one process on the one GPU, whether or not pytest-xdist (the suite's -n auto) is there
        cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-rfE",
               f"--junitxml={xml}", str(folder)]
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=sizes.step_timeout_s["tests"] - 10)
        counts = _junit_counts(xml) if xml.is_file() else {}
    out = (p.stdout + p.stderr)[-3000:]
    ok = p.returncode == 0 or p.returncode == 5 and device == "cpu"  # 5: none collected (no CUDA: by design)
    return {"status": "passed" if ok else "failed", "exit_code": p.returncode, "command": " ".join(cmd[1:]),
            **counts, "output_tail": out}


def _junit_counts(xml: Path) -> dict[str, Any]:
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return counts | {"failed_tests": failed}


def _workload(sizes: Sizes, vocab: int) -> list[Any]:
    from tdpipe.bench import workload as wl

    return wl.fixed(sizes.num_prompts, sizes.input_len, sizes.output_len, vocab, seed=0)


def job_engine(sizes: Sizes, device: str, model: str, depth: int | None = None) -> dict[str, Any]:
    """The engine on `model` (bf16): the fixed workload after a warm-up, with its trace's decode steps.
    `depth`: --pipeline-depth (micro-batches in flight; default the engine's)."""
    from tdpipe import LLM
    from tdpipe.bench.roofline import decode_events
    from tdpipe.bench.throughput import _timed_run

    spec = sizes.small_model if model == "small" else sizes.large_model
    path, what = model_folder(spec, device)
    cfg = json.loads((Path(path) / "config.json").read_text())
    reqs = _workload(sizes, cfg["vocab_size"])
    kw: dict[str, Any] = {"kv_cache_memory": 64 << 20} if device == "cpu" else {}
    if depth is not None:
        kw["pipeline_depth"] = depth
    with LLM(path, dtype="bfloat16", device=device, max_num_seqs=sizes.num_prompts, collect_trace=True, **kw) as llm:
        timed = _timed_run(llm, reqs)
        trace = llm.trace()
        events = decode_events(trace)
        kv_blocks = llm.engine.block_manager.num_blocks
    outs = timed["outs"]
    errors = [o.error for o in outs if o.error]
    produced = sum(len(o.outputs[0].token_ids) for o in outs if not o.error)
    expected = sum(r.output_len for r in reqs)
    st = timed["stats"]
    steps = _timed_steps(trace, st["prefill_steps"] + st["decode_steps"] + st["mixed_steps"], timed["elapsed"])
    biggest = max((e["decode_seqs"] for e in events), default=0)
    points = [[e["decode_seqs"], e["context_tokens"], e["end"] - e["start"]] for e in events
              if e["decode_seqs"] == biggest][:512]
    return {"status": "passed" if not errors and produced == expected else "failed", "model": what, "path": path,
            "model_config": {k: v for k, v in cfg.items() if not k.startswith("_")},
            "elapsed_s": timed["elapsed"], "output_tokens": produced, "expected_output_tokens": expected,
            "output_tokens_per_s": produced / timed["elapsed"], "errors": errors[:3], "kv_blocks": kv_blocks,
            "decode_steps": timed["stats"]["decode_steps"], "prefill_steps": timed["stats"]["prefill_steps"],
            "bubble_ratio": timed["summary"]["bubble_ratio"], "steps": steps, "pipeline_depth": depth,
            "decode_points": points}


def _timed_steps(trace: dict[str, Any], n: int, elapsed: float) -> dict[str, float]:
    """Where the timed run's `elapsed` seconds went, from the last stage's last n trace events (the timed
    run's steps): in prefill (and mixed) steps, in decode steps, the longest step, and outside every step
    (the engine's host work between them). A Triton compile inside the run shows as one long step."""
    from tdpipe.bench.roofline import last_stage_events

    ev = last_stage_events(trace)[-n:] if n else []
    dur = [(e["end"] - e["start"], bool(e.get("prefill_tokens"))) for e in ev]
    prefill, decode = sum(d for d, p in dur if p), sum(d for d, p in dur if not p)
    return {"prefill_s": prefill, "decode_s": decode, "longest_step_s": max((d for d, _ in dur), default=0.0),
            "outside_steps_s": elapsed - prefill - decode}


def job_hf(sizes: Sizes, device: str, model: str) -> dict[str, Any]:
    """transformers' batched generate on the same prompts: one left-padded batch of all of them."""
    import torch

    from tdpipe.bench.throughput import run_hf
    from tdpipe.tokenizer import load_tokenizer

    spec = sizes.small_model if model == "small" else sizes.large_model
    path, what = model_folder(spec, device)
    cfg = json.loads((Path(path) / "config.json").read_text())
    reqs = _workload(sizes, cfg["vocab_size"])
    tok = load_tokenizer(path)
    pad = tok.eos_token_id if tok.eos_token_id is not None else 0
    res = run_hf(path, reqs, len(reqs), torch.bfloat16, pad, device=device)
    return {"status": "passed", "model": what, **res}


JOBS: dict[str, Callable[..., dict[str, Any]]] = {"environment": job_environment, "parity": job_parity,
                                                  "tests": job_tests, "engine": job_engine, "hf": job_hf}


# -- the check ---------------------------------------------------------------------------------------------
class Runner:
    """Runs jobs in child processes (or in this one: `isolate=False`, the unit test) within one budget."""

    def __init__(self, sizes: Sizes, device: str, isolate: bool, budget_s: float, log_dir: Path | None) -> None:
        self.sizes, self.device, self.isolate, self.log_dir = sizes, device, isolate, log_dir
        self.deadline = time.monotonic() + budget_s

    def run(self, job: str, **kwargs: Any) -> dict[str, Any]:
        left = self.deadline - time.monotonic()
        if left < 15:
            return {"status": "not run", "error": "the check's time budget is spent"}
        limit = min(self.sizes.step_timeout_s[job], left)
        t = time.perf_counter()
        res = self._in_child(job, kwargs, limit) if self.isolate else self._here(job, kwargs)
        return res | {"seconds": time.perf_counter() - t}

    def _here(self, job: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            return JOBS[job](self.sizes, self.device, **kwargs)
        except Exception as e:  # noqa: BLE001 - a failing step is a result, the check goes on
            return {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}

    def _in_child(self, job: str, kwargs: dict[str, Any], limit: float) -> dict[str, Any]:
        name = job + "".join(f"-{v}" for v in kwargs.values())
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "result.json"
            cmd = [sys.executable, "-m", "tdpipe.bench.gpu_check", "_job", job, "--sizes", self.sizes.name,
                   "--device", self.device, "--kwargs", json.dumps(kwargs), "--out", str(out)]
            print(f"gpu-check: {name} (limit {limit:.0f} s)", file=sys.stderr, flush=True)
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
                log, code = p.stdout + p.stderr, p.returncode
            except subprocess.TimeoutExpired as e:
                log = _text(e.stdout) + _text(e.stderr)
                code = None
            self._keep_log(name, log)
            if code is None:
                return {"status": "error", "error": f"timed out after {limit:.0f} s", "log_tail": log[-3000:]}
            if not out.is_file():
                return {"status": "error", "error": f"the step's process exited with {code} and no result",
                        "log_tail": log[-3000:]}
            return json.loads(out.read_text())

    def _keep_log(self, name: str, log: str) -> None:
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / f"{name}.log").write_text(log)


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def throughput_step(runner: Runner, model: str, depth: int | None = None) -> dict[str, Any]:
    """Engine then transformers on the same prompts, each in its own process; the ratio of output tok/s."""
    engine = runner.run("engine", model=model, **({"depth": depth} if depth is not None else {}))
    hf = runner.run("hf", model=model) if engine["status"] == "passed" else {"status": "not run", "seconds": 0.0,
                                                                            "error": "the engine side failed"}
    step: dict[str, Any] = {"status": "passed" if engine["status"] == hf["status"] == "passed" else
                            ("error" if "error" in (engine["status"], hf["status"]) else "failed"),
                            "workload": {"prompts": runner.sizes.num_prompts, "input_len": runner.sizes.input_len,
                                         "output_len": runner.sizes.output_len},
                            "engine": engine, "transformers": hf,
                            "seconds": engine["seconds"] + hf["seconds"]}
    if step["status"] == "passed":
        step["ratio_vs_transformers"] = engine["output_tokens_per_s"] / hf["hf_output_tokens_per_s"]
    return step


def roofline_of(step: dict[str, Any], env: dict[str, Any]) -> dict[str, Any] | None:
    """The decode roofline of a throughput step's engine side, against the GPU's datasheet bandwidth
    (bench/gpu_specs.py) and against the copy bandwidth the environment step measured."""
    from tdpipe.bench.gpu_specs import SPECS, match_gpu
    from tdpipe.bench.roofline import roofline
    from tdpipe.config import ModelConfig

    engine = step.get("engine") or {}
    points = engine.get("decode_points") or []
    if step.get("status") != "passed" or not points:
        return None
    mc = ModelConfig.from_hf(engine["model_config"])
    events = [{"decode_seqs": d, "context_tokens": c, "start": 0.0, "end": s} for d, c, s in points]
    key = match_gpu(env.get("gpu"), env.get("gpu_memory_bytes"))
    out: dict[str, Any] = {"gpu_spec": key}
    if key is not None:
        out["datasheet"] = roofline(mc, events, SPECS[key].mem_bw)
    if env.get("copy_bytes_per_s"):
        out["measured_copy"] = roofline(mc, events, env["copy_bytes_per_s"])
    return out


def targets(doc: dict[str, Any]) -> dict[str, Any]:
    steps = doc["steps"]
    ratio = (steps.get("throughput_bundled") or {}).get("ratio_vs_transformers")
    roof = (steps.get("throughput_8b") or {}).get("roofline") or {}
    basis = "datasheet" if "datasheet" in roof else "measured_copy"  # a CPU (dry run) has no datasheet row
    frac = (roof.get(basis) or {}).get("fraction")
    return {"throughput_vs_transformers_bundled": {"target": TARGET_VS_TRANSFORMERS, "value": ratio,
                                                   "met": ratio is not None and ratio >= TARGET_VS_TRANSFORMERS},
            "decode_roofline_fraction_8b": {"target": TARGET_ROOFLINE, "value": frac, "bandwidth": basis,
                                            "batch": (roof.get(basis) or {}).get("batch"),
                                            "met": frac is not None and frac >= TARGET_ROOFLINE}}


def run_check(out: Path, device: str, sizes: Sizes, isolate: bool = True, budget_s: float = BUDGET_S,
              steps: list[str] | None = None, pipeline_depth: int | None = None) -> dict[str, Any]:
    """Every step in order; the JSON at `out` is rewritten after each. Returns the document.
    `pipeline_depth`: the engine's --pipeline-depth in the throughput steps (default: the engine's own)."""
    order = ["environment", "parity", "tests", "throughput_bundled", "throughput_8b"]
    unknown = sorted(set(steps or []) - set(order))
    if unknown:
        raise ValueError(f"unknown step(s) {unknown}; the steps are {order}")
    wanted = [s for s in order if steps is None or s in steps]
    runner = Runner(sizes, device, isolate, budget_s, out.with_name(out.name + ".logs") if isolate else None)
    t0 = time.perf_counter()
    doc: dict[str, Any] = {"schema": SCHEMA, "started": _now(), "device": device,
                           "mode": "gpu" if sizes is FULL else "dry run (tiny sizes)", "sizes": asdict(sizes),
                           "pipeline_depth": pipeline_depth, "environment": {}, "steps": {}}
    for name in wanted:
        if name == "environment":
            env = runner.run("environment")
            doc["environment"] = {k: v for k, v in env.items() if k not in ("status", "seconds")}
            res = {"status": env["status"], "seconds": env["seconds"], **({"error": env["error"]}
                                                                         if "error" in env else {})}
        elif name.startswith("throughput"):
            res = throughput_step(runner, "small" if name == "throughput_bundled" else "large", pipeline_depth)
            if name == "throughput_8b":
                try:
                    res["roofline"] = roofline_of(res, doc["environment"])
                except ValueError as e:
                    res["roofline"] = {"error": str(e)}
        else:
            res = runner.run(name)
        doc["steps"][name] = res
        print(f"gpu-check: {name}: {res['status']}" + (f" ({res['error']})" if res.get("error") else ""),
              file=sys.stderr, flush=True)
        _finish(doc, t0)
        _write(out, doc)
    return doc


def _finish(doc: dict[str, Any], t0: float) -> None:
    doc["finished"] = _now()
    doc["seconds"] = time.perf_counter() - t0
    doc["passed"] = bool(doc["steps"]) and all(s["status"] == "passed" for s in doc["steps"].values())
    doc["targets"] = targets(doc)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


def median_decode_ms(points: list[list[float]]) -> float:
    """The median step time, in ms, of an engine job's `decode_points` ([sequences, context tokens, s])."""
    return 1e3 * statistics.median(p[2] for p in points)


def summary(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = [f"gpu-check ({doc['mode']}) on {env.get('gpu') or env.get('cpu')}: driver {env.get('driver', '-')}, "
             f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}"]
    if env.get("matmul_bf16_tflops"):
        lines.append(f"  bf16 GEMM {env['matmul_n']}^3: {env['matmul_bf16_tflops']:.3g} TFLOP/s; copy "
                     f"{env['copy_bytes_per_s'] / 1e9:.3g} GB/s (read + write)")
    for name, s in doc["steps"].items():
        extra = f" ratio vs transformers {s['ratio_vs_transformers']:.2f}x" if "ratio_vs_transformers" in s else ""
        points = (s.get("engine") or {}).get("decode_points") or []
        if points:  # the figure an A/B of two trees compares (scripts/gpu_ab.sh prints the same)
            extra += f", median decode step {median_decode_ms(points):.2f} ms at batch {points[0][0]}"
        lines.append(f"  {name:<20} {s['status']:<8} {s.get('seconds', 0):6.1f} s{extra}"
                     + (f"  {s['error']}" if s.get("error") else ""))
    for k, t in doc["targets"].items():
        v = "-" if t["value"] is None else f"{t['value']:.3g}"
        lines.append(f"  target {k}: {v} (>= {t['target']}): {'met' if t['met'] else 'NOT met'}")
    lines.append(f"  {'PASSED' if doc['passed'] else 'FAILED'} in {doc['seconds']:.0f} s")
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------------------
def add_parser(sub: Any) -> Any:
    """`tdpipe gpu-check` and its `run` subcommand; returns the subcommands' group (cli.py adds `calibrate`,
    sim/gpu_cli.py: the simulator's row from a check's JSON)."""
    p = sub.add_parser("gpu-check", help="validate the GPU path in one command (GPU, or --dry-run on CPU)",
                       description="run: the CUDA tests, greedy parity with transformers (fp32, bf16; pp 1 and 2), "
                                   "throughput against transformers on the bundled model and a random Llama-3-8B, "
                                   "and the decode roofline, all into one JSON (docs/gpu.md). calibrate: a "
                                   "simulator hardware row from that JSON.")
    s = p.add_subparsers(dest="gpu_check", required=True)
    r = s.add_parser("run", help="run the check")
    r.add_argument("--json", default=None, metavar="FILE",
                   help="where the JSON goes (default: $OUT/gpu_check.json where OUT is set, else gpu_check.json)")
    r.add_argument("--dry-run", action="store_true",
                   help="run the same steps on the CPU at tiny sizes (also: TDPIPE_GPU_CHECK_DEVICE=cpu)")
    r.add_argument("--steps", default=None, metavar="A,B", help="only these steps (default: all)")
    r.add_argument("--pipeline-depth", type=int, default=None, metavar="N",
                   help="the engine's --pipeline-depth in the throughput steps (default: the engine's)")
    r.add_argument("--budget-s", type=float, default=BUDGET_S, help="time for the whole check (default %(default)s)")
    r.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # the unit test
    r.set_defaults(fn=cmd_run)
    return s


def cmd_run(a: argparse.Namespace) -> int:
    dry = a.dry_run or os.environ.get("TDPIPE_GPU_CHECK_DEVICE") == "cpu"
    if not dry:
        import torch

        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
            print(f"gpu-check: no CUDA device ({why}); --dry-run runs the steps on the CPU at tiny sizes",
                  file=sys.stderr)
            return 2
    out = Path(a.json or Path(os.environ.get("OUT") or ".") / "gpu_check.json")
    steps = [s for s in a.steps.split(",") if s] if a.steps else None
    doc = run_check(out, "cpu" if dry else "cuda", TINY if dry else FULL, isolate=not a.in_process,
                    budget_s=a.budget_s, steps=steps, pipeline_depth=a.pipeline_depth)
    print(summary(doc))
    print(f"gpu-check: wrote {out}")
    return 0 if doc["passed"] else 1


def _job_main(argv: list[str]) -> int:
    """`python -m tdpipe.bench.gpu_check _job NAME ...`: one job in this process, its result to --out."""
    p = argparse.ArgumentParser(prog="gpu_check _job")
    p.add_argument("job", choices=sorted(JOBS))
    p.add_argument("--sizes", choices=sorted(SIZES), required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--kwargs", default="{}")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    runner = Runner(SIZES[a.sizes], a.device, isolate=False, budget_s=1e9, log_dir=None)
    res = runner._here(a.job, json.loads(a.kwargs))
    _write(Path(a.out), res)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_job"]:
        return _job_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m tdpipe.bench.gpu_check")
    add_parser(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(["gpu-check", *argv])
    try:
        return a.fn(a)
    except ValueError as e:
        print(f"gpu-check: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["FULL", "SCHEMA", "TARGET_ROOFLINE", "TARGET_VS_TRANSFORMERS", "TINY", "add_parser", "model_folder",
           "roofline_of", "run_check", "summary", "targets"]
