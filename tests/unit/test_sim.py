"""The simulator: cost model, hardware table, KV capacity, SimExecutor timing, the engine over it, CLI, grid,
calibration fit and replay of real runs. No weights are loaded; the shipped model configs are used."""
import json
import math
from dataclasses import replace

import pytest

from tdpipe.config import ModelConfig
from tdpipe.model.weights import load_hf_config
from tdpipe.sim.cost import CostModel, StepShape, layer_params, model_bytes
from tdpipe.sim.hardware import GB, TABLE, Hardware, load_hardware
from tdpipe.sim.runner import DoesNotFit, SimConfig, kv_blocks_from_memory, resolve_sim_model, simulate
from tdpipe.step_input import StepInput


def mc_of(name: str) -> ModelConfig:
    return ModelConfig.from_hf(load_hf_config(resolve_sim_model(name)))


# -- models and the cost model ------------------------------------------------------------------------------
def test_shipped_model_sizes_match_the_paper():
    # TD-Pipe Table 2: 26 GB, 64 GB, 140 GB in 16-bit (rounded; Qwen's big vocab adds ~1.5 GB)
    assert model_bytes(mc_of("13b")) / GB == pytest.approx(26, rel=0.02)
    assert model_bytes(mc_of("32b")) / GB == pytest.approx(65.5, rel=0.02)
    assert model_bytes(mc_of("70b")) / GB == pytest.approx(138, rel=0.02)
    assert mc_of("llama-2-70b").num_kv_heads == 8 and mc_of("qwen2.5-32b").qkv_bias


def test_step_shape_counts_causal_pairs():
    s = StepShape.of([4, 1], [4, 10])  # a fresh 4-token prefill and one decode over 9 cached tokens
    assert (s.tokens, s.rows, s.kv_tokens) == (5, 2, 14)
    assert s.attn_qk == pytest.approx(4 * (0 + 2.5) + 1 * (9 + 1))  # prefill: 1+2+3+4 = 10 pairs


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    mc, hw = mc_of("70b"), TABLE["a100-80g"]
    cm = CostModel(mc, replace(hw, layer_overhead=0.0), [(0, 80)])
    decode = cm.layer_time(StepShape.of([1], [2]))
    weights = layer_params(mc) * 2 / (hw.mem_bw * hw.bw_eff)
    assert decode == pytest.approx(weights, rel=0.01)  # one token: reading the layer's weights dominates
    big = StepShape.of([4096], [4096])
    lin = 2 * 4096 * layer_params(mc) / (hw.flops * hw.flops_eff)
    assert cm.layer_time(big) > lin and cm.roofline(2 * 4096 * layer_params(mc), 1.0) == pytest.approx(lin)


def test_tensor_parallel_splits_compute_and_adds_two_allreduces():
    mc, hw = mc_of("13b"), replace(TABLE["l20"], layer_overhead=0.0)
    s = StepShape.of([2048], [2048])
    one = CostModel(mc, hw, [(0, 40)], tp=1).layer_time(s)
    four = CostModel(mc, hw, [(0, 40)], tp=4)
    ring = 2 * 3 / 4 * 2048 * mc.hidden_size * 2
    ar = 2 * (hw.allreduce_latency + ring / hw.allreduce_bw)
    assert four.layer_time(s) == pytest.approx(one / 4 + ar, rel=1e-6)
    with pytest.raises(ValueError, match="tensor parallel size"):
        CostModel(mc, hw, [(0, 40)], tp=0)


def test_stage_times_put_embedding_first_and_head_last():
    mc, hw = mc_of("13b"), TABLE["l20"]
    cm = CostModel(mc, hw, [(0, 20), (20, 40)])
    s = StepShape.of([1] * 64, [300] * 64)
    t0, t1 = cm.stage_times(s)
    assert t1 - t0 == pytest.approx(cm.head_time(s) - s.tokens * mc.hidden_size * 2 / (hw.mem_bw * hw.bw_eff))
    assert cm.send_times(s) == [pytest.approx(hw.link_latency + 64 * mc.hidden_size * 2 / hw.link_bw)]


# -- hardware and KV capacity ----------------------------------------------------------------------------
def test_hardware_table_has_the_papers_rows():
    assert TABLE["l20"].flops == 119.5e12 and TABLE["l20"].allreduce_bw == 14.65 * GB
    assert TABLE["a100-80g"].mem_bw == 1935 * GB and TABLE["a100-80g"].memory == 80 * GB
    assert {"a100-40g", "h100", "h200"} <= set(TABLE)


def test_hardware_json_round_trip_and_errors(tmp_path):
    f = tmp_path / "hw.json"
    f.write_text(json.dumps(TABLE["h100"].to_json() | {"name": "mine"}))
    assert load_hardware(str(f)).name == "mine"
    f.write_text(json.dumps(TABLE["h100"].to_json() | {"flops_eff": 1.5}))
    with pytest.raises(ValueError, match="flops_eff"):
        load_hardware(str(f))
    f.write_text(json.dumps({"name": "x", "flops": 1.0, "turbo": 1}))
    with pytest.raises(ValueError, match="turbo"):
        load_hardware(str(f))
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        load_hardware("tpu")


def test_kv_capacity_from_memory_minus_weights():
    mc, hw = mc_of("13b"), TABLE["l20"]
    blocks = kv_blocks_from_memory(mc, hw, [(0, 40)], 1, 16)
    free = 48 * GB * 0.9 - model_bytes(mc) - hw.reserve
    assert blocks == int(free // mc.kv_bytes_per_token(2)) // 16
    four = kv_blocks_from_memory(mc, hw, [(0, 10), (10, 20), (20, 30), (30, 40)], 1, 16)
    assert four > 4 * blocks  # four devices hold the weights once: far more than 4x the KV
    with pytest.raises(DoesNotFit, match="do not fit"):
        kv_blocks_from_memory(mc_of("70b"), TABLE["a100-80g"], [(0, 80)], 1, 16)


# -- the executor ---------------------------------------------------------------------------------------------
class _FixedCost:
    """Stage times chosen by hand: 1 s on stage 0, 2 s on stage 1, 0.5 s to send."""

    num_stages = 2
    hw = replace(TABLE["l20"], engine_step=0.1, engine_row=0.0)

    def stage_times(self, s):
        return [1.0, 2.0]

    def stage_allreduce(self, s):
        return [0.0, 0.0]

    def send_times(self, s):
        return [0.5]


def _step(i: int) -> StepInput:
    return StepInput(batch_id=i, token_ids=[5, 6], query_lens=[1, 1], seq_lens=[3, 3], block_tables=[[0], [1]],
                     is_prefill=False)


def test_sim_executor_pipelines_in_submission_order():
    from tdpipe.sim.executor import SIM_TOKEN, SimExecutor

    ex = SimExecutor(_FixedCost())
    ex.submit(_step(0))
    ex.submit(_step(1))
    r = ex.collect()  # batch 0: stage 0 [0, 1], send to 1.5, stage 1 [1.5, 3.5]
    assert r.batch_id == 0 and r.token_ids == [SIM_TOKEN, SIM_TOKEN]
    assert ex.now() == pytest.approx(3.5 + 0.1)
    ex.collect()  # batch 1: stage 0 [1, 2], arrives 2.5, stage 1 busy until 3.5 -> [3.5, 5.5]
    assert ex.now() == pytest.approx(5.5 + 0.1)
    s0, s1 = ex.trace_events()
    assert [(e["start"], e["end"]) for e in s0] == [(0.0, 1.0), (1.0, 2.0)]
    assert [(e["start"], e["end"], e["wait"]) for e in s1] == [(1.5, 3.5, 1.5), (3.5, 5.5, 0.0)]
    assert s0[0]["decode_seqs"] == 2 and s0[0]["send"] == 0.5 and s1[0]["send"] == 0.0


# -- the engine over it -----------------------------------------------------------------------------------------
def _reqs(n: int, vocab: int = 32000):
    from tdpipe.bench import workload as wl

    return wl.sharegpt_like(n, vocab, 0, 2048)


@pytest.mark.parametrize("policy,parallel", [("separate", "tp"), ("hybrid", "pp"), ("throttle", "pp"),
                                             ("td-pipe", "pp")])
def test_simulated_engine_finishes_every_request(policy, parallel):
    from tdpipe.core.scheduler import get_policy
    from tdpipe.sim.runner import build_engine
    from tdpipe.viz.timeline import validate_trace

    reqs = _reqs(120)
    cfg = SimConfig(TABLE["l20"], 2, parallel, "13b", num_kv_blocks=600, engine={"scheduler": policy})
    engine = build_engine(cfg)
    assert type(engine.scheduler) is get_policy(policy).cls  # the engine's own scheduler, not a copy
    assert engine.tokenizer is None
    res = simulate(cfg, reqs)
    assert res["finished"] == 120
    assert res["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert res["pp"] == (2 if parallel == "pp" else 1) and res["tp"] == (2 if parallel == "tp" else 1)
    assert 0 <= res["bubble_ratio"] < 1 and res["elapsed_s"] > 0
    assert res["output_tokens_per_s"] == pytest.approx(res["total_output_tokens"] / res["elapsed_s"])
    assert all(0 <= u <= 1 for _, u in res["kv_usage"]) and max(u for _, u in res["kv_usage"]) > 0.3


def test_simulation_is_deterministic_and_recomputes_when_the_cache_is_tight(tmp_path):
    from tdpipe.viz.timeline import load_trace, summarize

    reqs = _reqs(200)
    cfg = SimConfig(TABLE["a100-80g"], 4, "pp", "13b", num_kv_blocks=300, engine={"scheduler": "separate"})
    a = simulate(cfg, reqs, trace_path=str(tmp_path / "t.json"))
    b = simulate(cfg, reqs)
    assert a["elapsed_s"] == b["elapsed_s"] and a["preemptions"] == b["preemptions"] > 0
    trace = load_trace(tmp_path / "t.json")
    assert trace["pp"] == 4 and trace["machine"].startswith("simulated: 4x a100-80g")
    assert summarize(trace)["bubble_ratio"] == pytest.approx(a["bubble_ratio"])


def test_more_devices_more_throughput_and_tp_pays_allreduce():
    reqs = _reqs(300)
    one = simulate(SimConfig(TABLE["a100-80g"], 1, "pp", "13b"), reqs)
    four = simulate(SimConfig(TABLE["a100-80g"], 4, "pp", "13b", engine={"scheduler": "td-pipe"}), reqs)
    assert four["output_tokens_per_s"] > 1.3 * one["output_tokens_per_s"]  # 300 requests: the tail weighs
    slow = simulate(SimConfig(replace(TABLE["a100-80g"], allreduce_bw=1 * GB), 4, "tp", "13b"), reqs)
    fast = simulate(SimConfig(replace(TABLE["a100-80g"], allreduce_bw=300 * GB), 4, "tp", "13b"), reqs)
    assert fast["output_tokens_per_s"] > 1.5 * slow["output_tokens_per_s"]


def test_engine_without_tokenizer_rejects_text():
    from tdpipe.sampling.params import SamplingParams
    from tdpipe.sim.runner import build_engine

    engine = build_engine(SimConfig(TABLE["l20"], 1, "pp", "13b"))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("0", "hello", SamplingParams())
    with pytest.raises(ValueError, match="stop strings"):
        engine.add_request("0", [5, 6], SamplingParams(stop=["x"]))


# -- CLI -----------------------------------------------------------------------------------------------------
def test_cli_simulate_json_trace_and_plot(tmp_path, capsys):
    from tdpipe.cli import main

    j, t, png = tmp_path / "r.json", tmp_path / "t.json", tmp_path / "t.png"
    assert main(["simulate", "--hardware", "l20", "--num-devices", "2", "--model", "13b", "--scheduler", "td-pipe",
                 "--num-prompts", "60", "--json", str(j), "--trace", str(t)]) == 0
    out = capsys.readouterr().out
    assert "output tokens/s" in out and "2x l20" in out
    res = json.loads(j.read_text())
    assert res["simulated"] and res["num_requests"] == 60 and res["policy"] == "td-pipe"
    assert main(["plot", "timeline", str(t), "-o", str(png)]) == 0 and png.stat().st_size > 0


def test_cli_simulate_errors_name_the_problem(capsys):
    from tdpipe.cli import main

    assert main(["simulate", "--hardware", "a100-80g", "--num-devices", "1", "--model", "70b",
                 "--num-prompts", "5"]) == 2
    assert "do not fit" in capsys.readouterr().err
    assert main(["simulate", "--model", "gpt-5", "--num-prompts", "5"]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err


# -- grid -----------------------------------------------------------------------------------------------------
def test_grid_cell_and_claims():
    from tdpipe.sim import grid

    assert len(grid.cells()) == 4 * 3 * 10
    assert len(grid.cells([("a100-80g", "llama-2-70b")])) == 3 * 10
    oom = grid.run_cell({"hardware": "a100-80g", "model": "llama-2-70b", "devices": 1, "method": "TD-Pipe"}, 10, 0, {})
    assert "oom" in oom
    fake = []
    for hw, m in grid.PAIRS:
        for n in grid.DEVICES:
            for name in grid.METHODS:
                v = {"TD-Pipe": 2.0, "TP+SB": 1.0}.get(name, 1.6) * n
                fake.append({"hardware": hw, "model": m, "devices": n, "method": name, "output_tokens_per_s": v,
                             "bubble_ratio": 0.1})
    c = {x["claim"]: x["simulated"] for x in grid.claims(fake)}
    assert c["TD-Pipe / TP+SB at 4 devices, best pair"] == pytest.approx(2.0)
    assert c["TD-Pipe 4 devices / 2 devices, L20 + 32B"] == pytest.approx(2.0)
    assert "| TD-Pipe | 2 | 4 | 8 | 0.10 |" in grid.markdown(fake, {"num_prompts": 1, "seed": 0})


# -- calibration fit and replay -----------------------------------------------------------------------------------
def test_fit_recovers_known_parameters(bundled_path):
    from tdpipe.sim.calibrate import fit

    mc = ModelConfig.from_hf(load_hf_config(bundled_path))
    truth = Hardware("t", 400e9, 50e9, 1e10, 1e9, 1e9, flops_eff=0.4, bw_eff=0.6, attn_eff=0.05,
                     layer_overhead=50e-6, step_overhead=2e-3)
    shapes = [([t], [t]) for t in (16, 64, 256, 1024)] + [([1] * b, [c] * b) for b in (1, 8, 64) for c in (128, 512)]
    cm = CostModel(mc, truth, [(0, mc.num_layers)])
    points = [{"query_lens": q, "seq_lens": s, "s": cm.stage_times(StepShape.of(q, s))[0]} for q, s in shapes]
    hw, err = fit(mc, replace(truth, flops_eff=1.0, bw_eff=1.0, attn_eff=1.0, layer_overhead=0.0,
                              step_overhead=0.0), points)
    assert err["rms_relative_error"] < 0.05
    assert hw.flops_eff == pytest.approx(0.4, rel=0.15)
    # one model, one layer count: only the total fixed cost per step is identifiable, not its split
    L = mc.num_layers
    assert L * hw.layer_overhead + hw.step_overhead == pytest.approx(L * 50e-6 + 2e-3, rel=0.2)


def test_replay_of_a_bench_file(tmp_path, monkeypatch):
    from tdpipe.bench import workload as wl
    from tdpipe.sim import calibrate, fidelity

    row = Hardware("cpu-1t", 400e9, 50e9, 1e10, 2e9, 2e9, threads=1)
    monkeypatch.setattr(calibrate, "cpu_hardware", lambda threads=None, **_: row)
    reqs = wl.sharegpt_like(20, 49152, 3, 2048)
    bench = {"policy": "separate", "pp": 2, "stage_threads": [1, 1], "layer_partition": [17, 13], "kv_blocks": 400,
             "num_requests": 20, "workload": {"name": "sharegpt", "seed": 3},
             "total_input_tokens": sum(r.input_len for r in reqs),
             "total_output_tokens": sum(r.output_len for r in reqs), "output_tokens_per_s": 100.0,
             "bubble_ratio": 0.2, "preemptions": 0, "decode_steps": 10,
             "engine": {"model": None, "scheduler": "separate", "max_num_seqs": 256, "max_model_len": 8192,
                        "future_points": [32, 1024], "max_num_batched_tokens": None}}
    f = tmp_path / "b.json"
    f.write_text(json.dumps(bench))
    r = fidelity.replay(str(f))
    assert r["pp"] == 2 and r["sim_output_tokens_per_s"] > 0
    assert r["throughput_error"] == pytest.approx(r["sim_output_tokens_per_s"] / 100.0 - 1)
    assert "| separate | 2 | 100.0 |" in fidelity.markdown([r])
    f.write_text(json.dumps(bench | {"simulated": True}))
    with pytest.raises(ValueError, match="simulated result"):
        fidelity.replay(str(f))
    assert not math.isnan(r["sim_bubble_ratio"])


@pytest.mark.parametrize("rule", ["intensity", "reachable-intensity"])
def test_td_pipe_intensity_rules_profile_the_simulated_executor(rule):
    from tdpipe.sim.runner import build_engine

    engine = build_engine(SimConfig(TABLE["l20"], 2, "pp", "13b",
                                    engine={"scheduler": "td-pipe", "switch_to_prefill": rule}))
    c = engine.scheduler.costs
    assert c.source == "profile" and c.peak_batch == 256  # 256 per stage x 2 stages / 2, past the CPU's 128
    assert c.decode_time(256) > c.decode_time(1) > 0 and c.prefill_time(2048) > c.prefill_time(64)
