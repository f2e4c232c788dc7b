"""The simulator's P x T layouts: --pp/--tp and their shorthands, the all-reduce split (TD-Pipe Fig. 6),
KV heads replicated past their count, node boundaries, and the two studies on small inputs."""
from __future__ import annotations

import argparse
import json

import pytest

from tdpipe.bench.workload import fixed
from tdpipe.config import ModelConfig
from tdpipe.sim.cost import CostModel, StepShape, check_tensor_parallel, kv_heads_per_device
from tdpipe.sim.hardware import GB, TABLE
from tdpipe.sim.layouts import figure6, layouts_of, sweep
from tdpipe.sim.runner import SimConfig, sim_model_config, simulate


def _args(*argv: str) -> argparse.Namespace:
    from tdpipe.cli import build_parser

    return build_parser().parse_args(["simulate", *argv])


def _mc(name: str) -> ModelConfig:
    return ModelConfig.from_hf(sim_model_config(name)[1])


@pytest.mark.parametrize("argv, want", [
    ([], (4, 1)), (["--parallel", "tp"], (1, 4)), (["--num-devices", "8"], (8, 1)),
    (["--num-devices", "8", "--parallel", "tp"], (1, 8)), (["--pp", "2", "--tp", "2"], (2, 2)),
    (["--tp", "4"], (1, 4)), (["--pp", "3"], (3, 1)), (["--num-devices", "8", "--tp", "2"], (4, 2)),
    (["--num-devices", "8", "--pp", "2"], (2, 4)), (["--pp", "4", "--parallel", "pp"], (4, 1)),
])
def test_layout_flags_and_shorthands(argv, want):
    from tdpipe.sim.cli import resolve_layout

    assert resolve_layout(_args(*argv)) == want


@pytest.mark.parametrize("argv, msg", [
    (["--num-devices", "8", "--pp", "2", "--tp", "2"], "--num-devices 8 is not --pp 2 x --tp 2 = 4"),
    (["--parallel", "tp", "--pp", "2"], "--parallel tp contradicts --pp 2 --tp 1"),
    (["--tp", "0"], "--tp must be >= 1, got 0"),
])
def test_layout_flags_that_disagree_name_them(argv, msg):
    from tdpipe.sim.cli import resolve_layout

    with pytest.raises(ValueError, match=msg.replace("+", r"\+")):
        resolve_layout(_args(*argv))


def _run(pp: int, tp: int, parallel: str = "pp", shorthand: bool = False) -> dict:
    reqs = fixed(24, 64, 32, vocab_size=32000, seed=0)
    n = pp * tp
    cfg = (SimConfig(TABLE["l20"], n, parallel, "13b", num_kv_blocks=4000) if shorthand else
           SimConfig(TABLE["l20"], n, "pp", "13b", num_kv_blocks=4000, tensor_parallel=tp))
    return simulate(cfg, reqs)


def test_shorthands_equal_the_explicit_layout():
    assert _run(4, 1)["output_tokens_per_s"] == _run(4, 1, "pp", shorthand=True)["output_tokens_per_s"]
    assert _run(1, 4)["output_tokens_per_s"] == _run(1, 4, "tp", shorthand=True)["output_tokens_per_s"]


def test_two_by_two_runs_and_reports_its_layout_and_all_reduce_share():
    r = _run(2, 2)
    assert (r["pp"], r["tp"], r["num_devices"], r["parallel"]) == (2, 2, 4, "2x2")
    assert len(r["bubble_ratio_per_stage"]) == 2 and r["finished"] == 24
    assert 0 < r["allreduce_share"] < 1
    assert all(c > 0 and a > 0 for c, a in zip(r["compute_s_per_stage"], r["allreduce_s_per_stage"]))
    assert r["busy_s_per_stage"] == pytest.approx([c + a for c, a in zip(r["compute_s_per_stage"],
                                                                         r["allreduce_s_per_stage"])])
    one = _run(4, 1)
    assert one["allreduce_share"] == 0 and sum(one["allreduce_s_per_stage"]) == 0


def test_all_reduce_grows_with_tp_and_compute_shrinks():
    mc, hw = _mc("llama-30b"), TABLE["l20"]
    s = StepShape.of([1024, 1024], [1024, 1024])
    parts = []
    for tp in (1, 2, 4):
        cm = CostModel(mc, hw, [(0, mc.num_layers)], tp)
        parts.append((cm.layer_time(s) - cm.allreduce_time(s), cm.allreduce_time(s)))
    assert parts[0][1] == 0 < parts[1][1] < parts[2][1]
    assert parts[0][0] > parts[1][0] > parts[2][0]
    # ring all-reduce by hand: 2 per layer, each latency + 2 (t - 1) / t * tokens * hidden * 2 bytes / bw
    ring = 2 * 3 / 4 * 2048 * mc.hidden_size * 2
    assert parts[2][1] == pytest.approx(2 * (hw.allreduce_latency + ring / hw.allreduce_bw))


def test_kv_heads_split_then_replicate_and_impossible_splits_name_the_sizes():
    mc = _mc("llama-3.1-405b")  # 128 heads, 8 KV heads
    assert [kv_heads_per_device(mc, t) for t in (1, 2, 8, 16)] == [8, 4, 1, 1]
    check_tensor_parallel(mc, 16)  # replicated KV heads, as vLLM does
    with pytest.raises(ValueError, match="tensor parallel size 3 cannot split the model: its 128 attention heads"):
        check_tensor_parallel(mc, 3)
    with pytest.raises(ValueError, match="its 52 attention heads"):
        check_tensor_parallel(_mc("llama-30b"), 8)


def test_a_tp_group_or_a_stage_boundary_across_nodes_uses_the_nic():
    mc, hw = _mc("llama-3.1-405b"), TABLE["h100-nvl"]
    s = StepShape.of([1] * 64, [500] * 64)
    inside, across = CostModel(mc, hw, [(0, 126)], 8), CostModel(mc, hw, [(0, 126)], 16)
    assert inside.allreduce_bw == hw.allreduce_bw and across.allreduce_bw == hw.internode_bw
    four = CostModel(mc, hw, [(0, 32), (32, 64), (64, 96), (96, 126)], 4)  # stages 0-1 node 0, 2-3 node 1
    sends = four.send_times(s)
    assert sends[0] == sends[2] < sends[1]  # only the boundary between stages 1 and 2 crosses nodes
    assert sends[1] == pytest.approx(hw.link_latency + 64 * mc.hidden_size * 2 / hw.internode_bw)


def test_sweep_covers_every_layout_and_marks_the_impossible_ones():
    assert layouts_of(16) == [(16, 1), (8, 2), (4, 4), (2, 8), (1, 16)]
    assert layouts_of(6) == [(6, 1), (3, 2), (2, 3), (1, 6)]
    reqs = fixed(16, 64, 16, vocab_size=32000, seed=0)
    rows = sweep(6, "l20", "llama-2-13b", ["hybrid"], reqs, {"max_num_seqs": 32})  # 40 heads: t = 3 and 6 fail
    assert [r["layout"] for r in rows] == ["6x1", "3x2", "2x3", "1x6"]
    assert "error" in rows[2] and "tensor parallel size 3" in rows[2]["error"] and "error" in rows[3]
    assert all(r["output_tokens_per_s"] > 0 for r in rows[:2])
    assert rows[0]["vs_pure_tp"] is None  # no pure-TP row to compare against


def test_figure6_rows_split_compute_and_all_reduce(tmp_path):
    rows = figure6(["l20"], "llama-30b", 2048, 2, [1, 2, 3, 4])
    ok = [r for r in rows if "error" not in r]
    assert [r["tp"] for r in ok] == [1, 2, 4] and "52 attention heads" in rows[2]["error"]
    assert ok[0]["comm_share"] == 0 and ok[0]["speedup_vs_1"] == 1
    assert ok[1]["comm_share"] < ok[2]["comm_share"] and 1 < ok[1]["speedup_vs_1"] < ok[2]["speedup_vs_1"] < 4
    assert ok[2]["paper_speedup"] == 1.84
    for r in ok:
        assert r["total_ms"] == pytest.approx(r["compute_ms"] + r["allreduce_ms"])


def test_figure6_command_writes_json_markdown_and_plot(tmp_path):
    from tdpipe.cli import main

    out = tmp_path / "f6"
    code = main(["simulate", "--figure6", "--hardware", "l20", "--json", f"{out}.json", "--markdown",
                           f"{out}.md", "--plot", f"{out}.png"])
    assert code == 0
    data = json.loads((tmp_path / "f6.json").read_text())
    assert data["meta"]["model"] == "llama-30b" and len(data["rows"]) == 4
    assert "| l20 | 4 |" in (tmp_path / "f6.md").read_text()
    assert (tmp_path / "f6.png").read_bytes()[:4] == b"\x89PNG"


def test_hardware_json_accepts_the_node_fields(tmp_path):
    from tdpipe.sim.hardware import load_hardware

    f = tmp_path / "hw.json"
    f.write_text(json.dumps({"name": "x", "flops": 1e14, "mem_bw": 1e12, "memory": 8e10, "allreduce_bw": 1e11,
                             "link_bw": 1e11, "node_size": 4, "internode_bw": 2.5e10}))
    hw = load_hardware(str(f))
    assert hw.node_size == 4 and hw.internode_bw == 25 * GB
