"""Prefill/decode disaggregation in the simulator (sim/pd.py): the KV's size and its transfer time, the decode
side charging an arrival one query token, and whole runs on shipped configs (no weights are read)."""
import pytest

from tdpipe.bench import workload as wl
from tdpipe.sim.cost import CostModel, StepShape
from tdpipe.sim.hardware import GB, load_hardware
from tdpipe.sim.pd import ArrivedKVExecutor, PDConfig, kv_bytes_per_token, simulate_pd, transfer_time
from tdpipe.sim.runner import DoesNotFit, sim_model_config
from tdpipe.step_input import StepInput


def reqs(n: int, model: str, seed: int = 0):
    return wl.sharegpt_like(n, sim_model_config(model)[1]["vocab_size"], seed, 2048)


def test_kv_bytes_per_token_and_transfer_time():
    hf70 = sim_model_config("llama-2-70b")[1]  # 80 layers, 8 KV heads of 128 (GQA)
    assert kv_bytes_per_token(hf70) == 2 * 80 * 8 * 128 * 2
    assert kv_bytes_per_token(sim_model_config("llama-2-13b")[1]) == 2 * 40 * 40 * 128 * 2  # MHA
    hw = load_hardware("a100-80g")
    nbytes = 200 * kv_bytes_per_token(hf70)
    one = transfer_time(nbytes, hw, 1, 3)
    assert one == pytest.approx(hw.link_latency + nbytes / hw.link_bw)
    assert transfer_time(nbytes, hw, 2, 2) - hw.link_latency == pytest.approx((one - hw.link_latency) / 2)
    assert transfer_time(nbytes, hw, 2, 2, link_bw=1 * GB) > one


def test_an_arrival_costs_one_query_token_once_then_a_recompute_costs_in_full():
    from tdpipe.config import ModelConfig

    mc = ModelConfig.from_hf(sim_model_config("llama-2-13b")[1])
    hw = load_hardware("l20")
    cost = CostModel(mc, hw, [(0, 40)])
    ex = ArrivedKVExecutor(cost)
    ex.arrived.add(5)
    step = StepInput(0, [1] * 301, [300, 1], [300, 51], [[0], [1]], True, seq_ids=[5, 6])
    ex.submit(step)
    ex.collect()
    charged = ex.trace_events()[0][0]
    want = cost.stage_times(StepShape.of([1, 1], [300, 51]))[0]
    assert charged["end"] - charged["start"] == pytest.approx(want)
    assert not ex.arrived
    ex.submit(StepInput(1, [1] * 300, [300], [300], [[0]], True, seq_ids=[5]))  # preempted there: recompute
    ex.collect()
    again = ex.trace_events()[0][0]
    assert again["end"] - again["start"] == pytest.approx(cost.stage_times(StepShape.of([300], [300]))[0])


def test_a_pd_run_finishes_every_request_and_reports_latency():
    rs = reqs(60, "llama-2-13b")
    r = simulate_pd(PDConfig(load_hardware("l20"), 1, 1, "llama-2-13b"), rs)
    assert r["finished"] == 60 and r["parallel"] == "1P+1D"
    assert r["total_output_tokens"] == sum(x.output_len for x in rs)
    assert r["output_tokens_per_s"] == pytest.approx(r["total_output_tokens"] / r["elapsed_s"])
    # the prefill side only prefills, the decode side recomputes nothing it was sent
    assert r["prefill"]["decode_steps"] == 0 and r["prefill"]["policy"] == "separate"
    assert r["decode"]["policy"] == "hybrid" and r["decode"]["preemptions"] == 0
    assert 0 < r["ttft_mean_s"] <= r["ttft_p99_s"] < r["elapsed_s"]
    assert 0 < r["tpot_p50_s"] <= r["tpot_p99_s"]
    assert r["kv_transfer_mean_s"] == pytest.approx(
        sum(transfer_time(x.input_len * r["kv_bytes_per_token"], load_hardware("l20"), 1, 1) for x in rs) / 60)
    assert 0 <= r["bubble_ratio"] < 1
    # a slow link makes the transfers the bottleneck: the same run takes longer, the links are busy
    slow = simulate_pd(PDConfig(load_hardware("l20"), 1, 1, "llama-2-13b", link_bw=0.05 * GB), rs)
    assert slow["elapsed_s"] > 1.5 * r["elapsed_s"] and slow["kv_link_busy"] > 0.5


def test_a_side_without_room_for_its_weights_does_not_fit():
    with pytest.raises(DoesNotFit):
        simulate_pd(PDConfig(load_hardware("a100-80g"), 1, 3, "llama-2-70b"), reqs(4, "llama-2-70b"))
    with pytest.raises(ValueError, match="prefill_parallel"):
        PDConfig(load_hardware("l20"), 1, 1, prefill_parallel="dp")


def test_grid_pd_cells():
    from tdpipe.sim import grid

    one = grid.run_cell({"hardware": "l20", "model": "llama-2-13b", "devices": 1, "method": "PD (half prefill)"},
                        10, 0, {})
    assert "invalid" in one
    two = grid.run_cell({"hardware": "l20", "model": "llama-2-13b", "devices": 2, "method": "PD (1 prefill device)"},
                        20, 0, {})
    assert two["parallel"] == "1P+1D" and two["output_tokens_per_s"] > 0 and len(two["kv_capacity_tokens"]) == 2
    assert grid.parse_pairs("a100-80g/llama-2-70b") == [("a100-80g", "llama-2-70b")]
    with pytest.raises(ValueError, match="--pairs"):
        grid.parse_pairs("h100/llama-2-70b")
