"""Prefill/decode disaggregation in space (DistServe; the lecture's §4) at simulated scale: P devices prefill,
D devices decode, the KV cache crosses the interconnect in between.

Two real engines over SimExecutors share one virtual clock:
  - the prefill instance (P devices, a pipeline or a TP group) runs `separate` on prompts alone: each request
    is prefilled and gets its first token there (max_tokens = 1), so prompts go back to back and its pipeline
    never waits on a decode;
  - the request's KV (prompt tokens x 2 x layers x KV heads x head_dim x dtype bytes) is then sent to the
    decode instance: time = link_latency + bytes / (link_bw x min(P, D)), since every device sends its own
    layers' (or heads') share over its own link; transfers queue FIFO on those links. Not modelled: sending
    layer by layer while the prefill still runs (the transfer starts once the prefill batch returns), and the
    prefill side holding the KV until it is sent (freed at the first token);
  - the decode instance (D devices) admits a request once its KV has arrived and there is room in its own KV
    cache, and decodes continuously: `hybrid` with a budget no prompt reaches, so arrivals join the running
    decodes' micro-batches whole. The arrival's "prefill" row costs what it really costs there, one query
    token over the transferred context (ArrivedKVExecutor); a request preempted there recomputes in full.
Each side sizes its KV cache from its own devices' memory after its own copy of the weights, so a model that
barely fits P or D devices leaves that side little KV: the price of disaggregation on a small node.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

from tdpipe.sim.executor import SimExecutor
from tdpipe.sim.hardware import Hardware
from tdpipe.step_input import StepInput

# the decode side never chunks an arrival: a budget above any prompt plus every running decode
NO_CHUNK_BUDGET = 1 << 24


def kv_bytes_per_token(hf: dict[str, Any], dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers and KV heads: what a request's prompt sends per token."""
    from tdpipe.config import ModelConfig

    mc = ModelConfig.from_hf(hf)
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype_bytes


def transfer_time(nbytes: float, hw: Hardware, prefill_devices: int, decode_devices: int,
                  link_bw: float | None = None) -> float:
    """One request's KV over the links between the two instances (each device sends its share on its own)."""
    return hw.link_latency + nbytes / ((link_bw or hw.link_bw) * min(prefill_devices, decode_devices))


class ArrivedKVExecutor(SimExecutor):
    """The decode instance's executor: a request whose KV arrived from the prefill instance computes one query
    token (over its whole context) in its first step there, not its prompt again."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.arrived: set[int] = set()  # seq ids whose KV was transferred and not yet used

    def submit(self, step: StepInput) -> None:
        if self.arrived and any(s in self.arrived for s in step.seq_ids):
            q = [1 if s in self.arrived and n > 1 else n for s, n in zip(step.seq_ids, step.query_lens)]
            self.arrived.difference_update(step.seq_ids)
            step = replace(step, query_lens=q, token_ids=[])
        super().submit(step)


@dataclass
class PDConfig:
    hardware: Hardware
    prefill_devices: int  # P
    decode_devices: int  # D
    model: str | None = None
    prefill_parallel: str = "pp"  # how each instance spreads over its devices: pp (stages) or tp
    decode_parallel: str = "pp"
    link_bw: float | None = None  # bytes/s per device link for the KV; None: the hardware's link_bw
    engine: dict[str, Any] = field(default_factory=dict)  # shared engine keywords (max_num_seqs, block_size...)
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("prefill_devices", "decode_devices"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("prefill_parallel", "decode_parallel"):
            if getattr(self, name) not in ("pp", "tp"):
                raise ValueError(f"{name} must be 'pp' or 'tp', got {getattr(self, name)!r}")


def _side(cfg: PDConfig, prefill: bool):
    from tdpipe.sim.runner import SimConfig

    n, par = ((cfg.prefill_devices, cfg.prefill_parallel) if prefill else (cfg.decode_devices, cfg.decode_parallel))
    kw = {k: v for k, v in cfg.engine.items() if v is not None}
    kw.pop("scheduler", None)
    if prefill:
        kw |= {"scheduler": "separate"}
    else:
        kw |= {"scheduler": "hybrid", "max_num_batched_tokens": NO_CHUNK_BUDGET}
    return SimConfig(cfg.hardware, n, par, cfg.model, cfg.dtype_bytes, engine=kw)


def simulate_pd(cfg: PDConfig, reqs: list) -> dict[str, Any]:
    """Run the requests (all submitted at time 0) through P prefill + D decode devices; throughput, latency
    (TTFT, TPOT), the KV transfers and each side's bubble ratio. Raises runner.DoesNotFit when either side
    has no room for a KV cache."""
    from tdpipe.sampling.params import SamplingParams
    from tdpipe.sim.executor import SIM_TOKEN
    from tdpipe.sim.runner import build_engine, sim_model_config
    from tdpipe.viz.timeline import summarize

    wall0 = time.perf_counter()
    _, hf = sim_model_config(cfg.model)
    pre = build_engine(_side(cfg, True))
    dec = build_engine(_side(cfg, False), executor_cls=ArrivedKVExecutor)
    max_len = min(pre.scheduler.config.max_model_len, dec.scheduler.config.max_model_len)
    for k, r in enumerate(reqs):
        if r.input_len + r.output_len > max_len:
            raise ValueError(f"request {k}: {r.input_len} + {r.output_len} tokens exceed max_model_len {max_len}")
    per_token = kv_bytes_per_token(hf, cfg.dtype_bytes)
    for e in (pre, dec):
        e.reset_trace()
    t0 = pre.clock()  # both clocks start at 0 (start-up profiles ran before; none for these two policies)
    for k, r in enumerate(reqs):
        pre.add_request(str(k), r.prompt_token_ids, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1))
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    arrivals: list[tuple[float, int]] = []  # (KV arrival time, request index): a heap
    link_free = t0
    transfers: list[float] = []
    arrived: list[tuple[float, Any]] = []  # (KV arrival time, the decode side's sequence)
    inf = math.inf
    while pre.has_unfinished() or dec.has_unfinished() or arrivals:
        tp = pre.clock() if pre.has_unfinished() else inf
        td = dec.clock() if dec.has_unfinished() else (max(dec.clock(), arrivals[0][0]) if arrivals else inf)
        if tp < td:  # the prefill side is behind: step it; its finished prompts start their KV transfer
            for d in pre.step():
                if not d.finished:
                    continue
                now = pre.clock()
                k = int(d.request_id)
                first[d.request_id] = now
                if reqs[k].output_len <= 1:
                    done[d.request_id] = now
                    continue
                dt = transfer_time(reqs[k].input_len * per_token, cfg.hardware, cfg.prefill_devices,
                                   cfg.decode_devices, cfg.link_bw)
                start = max(now, link_free)
                link_free = start + dt
                transfers.append(dt)
                heapq.heappush(arrivals, (link_free, k))
            continue
        if not dec.has_unfinished():  # idle until the next KV arrives
            dec.executor.clock = max(dec.executor.clock, arrivals[0][0])
        while arrivals and arrivals[0][0] <= dec.clock():
            at, k = heapq.heappop(arrivals)
            r = reqs[k]
            seq = dec.add_request(str(k), list(r.prompt_token_ids) + [SIM_TOKEN],
                                  SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len - 1))
            dec.executor.arrived.add(seq.seq_id)
            arrived.append((at, seq))
        for d in dec.step():
            if d.finished:
                done[d.request_id] = dec.clock()
    elapsed = max(done.values()) - t0
    in_tok = sum(r.input_len for r in reqs)
    out_tok = sum(r.output_len for r in reqs)
    ttft = [first[str(k)] - t0 for k in range(len(reqs))]
    tpot = [(done[str(k)] - first[str(k)]) / (r.output_len - 1) for k, r in enumerate(reqs) if r.output_len > 1]
    # KV arrival -> the decode side's first token (the request's second): waiting for room, plus one step
    waits = [s.first_token_time - at for at, s in arrived if s.first_token_time is not None]
    from tdpipe.sim.runner import _breakdown

    sides = {}
    busy = 0.0  # device-seconds computing, both sides
    for name, e, n, par in (("prefill", pre, cfg.prefill_devices, cfg.prefill_parallel),
                            ("decode", dec, cfg.decode_devices, cfg.decode_parallel)):
        tr = e.trace()
        summary = summarize(tr)
        busy += sum(_breakdown(tr)["busy_s_per_stage"]) * (n // e.pp)  # each stage: n / pp devices (tp)
        bm = e.block_manager
        sides[name] = {"devices": n, "parallel": par, "policy": e.scheduler.config.policy,
                       "pp": e.pp, "kv_capacity_tokens": bm.num_blocks * bm.block_size,
                       "max_num_seqs": e.scheduler.config.max_num_seqs,
                       "bubble_ratio": summary["bubble_ratio"], "preemptions": e.scheduler.num_preemptions,
                       "prefill_steps": e.stats.prefill_steps, "decode_steps": e.stats.decode_steps,
                       "mixed_steps": e.stats.mixed_steps}
        e.shutdown()
    hw = cfg.hardware
    return {
        "simulated": True, "disaggregation": "pd", "hardware": hw.to_json(),
        "num_devices": cfg.prefill_devices + cfg.decode_devices,
        "parallel": f"{cfg.prefill_devices}P+{cfg.decode_devices}D", "model": _model_name(cfg),
        "num_requests": len(reqs), "finished": len(done), "elapsed_s": elapsed,
        "requests_per_s": len(reqs) / elapsed, "output_tokens_per_s": out_tok / elapsed,
        "total_tokens_per_s": (in_tok + out_tok) / elapsed,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "ttft_mean_s": _mean(ttft), "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_mean_s": _mean(tpot), "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "kv_bytes_per_token": per_token, "kv_link_bw": cfg.link_bw or hw.link_bw,
        "kv_transfer_mean_s": _mean(transfers), "kv_transfer_total_s": sum(transfers),
        "kv_link_busy": sum(transfers) / elapsed if elapsed else 0.0,
        "decode_start_mean_s": _mean(waits),  # KV arrival to the decode side's first token
        # idle share of all P + D devices over the whole run (a side with nothing left to do idles too);
        # each side's own bubble ratio, over its own busy span, is in its entry
        "bubble_ratio": 1.0 - busy / ((cfg.prefill_devices + cfg.decode_devices) * elapsed) if elapsed else 0.0,
        "prefill": sides["prefill"], "decode": sides["decode"],
        "sim_wall_s": time.perf_counter() - wall0,
    }


def _model_name(cfg: PDConfig) -> str:
    from pathlib import Path

    from tdpipe.sim.runner import resolve_sim_model

    return Path(resolve_sim_model(cfg.model)).name


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(p / 100 * (len(ys) - 1))))]


__all__ = ["ArrivedKVExecutor", "NO_CHUNK_BUDGET", "PDConfig", "kv_bytes_per_token", "simulate_pd", "transfer_time"]
