"""The simulator's GPU rows: published peaks and achieved fractions, the GPU-name match, and the row
re-calibrated from a gpu-check JSON (sim/gpu_calibrate.py). No GPU and no weights."""
import json
from dataclasses import replace

import pytest

from tdpipe.config import ModelConfig
from tdpipe.sim import hardware as hwmod
from tdpipe.sim.cost import CostModel, StepShape
from tdpipe.sim.hardware import GB, TABLE, TFLOPS, load_hardware, match_gpu
from tdpipe.bench.gpu_check import model_config


def test_gpu_rows_carry_the_cited_datasheet_peaks_and_fractions():
    h100, a100 = TABLE["h100"], TABLE["a100-sxm4-80g"]
    assert (h100.flops, h100.mem_bw, h100.memory) == (989.4 * TFLOPS, 3350 * GB, 80 * GB)
    assert h100.flops_eff == pytest.approx(794.5 / 989) and h100.bw_eff == pytest.approx(3.0 / 3.35)
    assert h100.attn_eff == 0.35 and TABLE["h200"].bw_eff == pytest.approx(4.3 / 4.8)
    assert (a100.flops, a100.mem_bw) == (312 * TFLOPS, 2039 * GB) and a100.flops_eff == pytest.approx(271.2 / 312)
    assert TABLE["a100-80g"].flops_eff == pytest.approx(252.9 / 312) and TABLE["a100-80g"].bw_eff == a100.bw_eff
    for row in TABLE.values():
        assert 0 < row.flops_eff <= 1 and 0 < row.bw_eff <= 1 and 0 < row.attn_eff <= 1 and row.source


@pytest.mark.parametrize("name,memory,row", [
    ("NVIDIA H100 80GB HBM3", 85e9, "h100"), ("NVIDIA H200", 150e9, "h200"), ("NVIDIA H100 NVL", 100e9, None),
    ("NVIDIA H100 PCIe", 85e9, None), ("NVIDIA A100-SXM4-80GB", 85e9, "a100-sxm4-80g"),
    ("NVIDIA A100 80GB PCIe", 85e9, "a100-80g"), ("NVIDIA A100-SXM4-40GB", 42e9, "a100-40g"),
    ("NVIDIA L4", 24e9, None), (None, None, None)])
def test_a_gpu_name_finds_its_row(name, memory, row):
    assert match_gpu(name, memory) == row


def _check_doc(excess_s: float) -> dict:
    """A gpu-check JSON as an H100 run would write it: the environment's peaks and the 8B decode steps,
    each `excess_s` slower than the calibrated row's roofline."""
    hf = {k: v for k, v in model_config("llama-3-8b").items() if not k.startswith("_")}
    mc = ModelConfig.from_hf(hf)
    measured = replace(TABLE["h100"], flops_eff=790 / 989.4, bw_eff=3.0e12 / 3.35e12, layer_overhead=0.0,
                       step_overhead=0.0)
    cm = CostModel(mc, measured, [(0, mc.num_layers)])
    points = [[256, c, cm.stage_times(StepShape(256, 256, float(c), c))[0] + excess_s]
              for c in (256 * 130, 256 * 180, 256 * 250)]
    return {"schema": "tdpipe-gpu-check/1", "finished": "2026-11-26T00:00:00+00:00",
            "environment": {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "torch": "2.11.0+cu130",
                            "gpu_memory_bytes": 85520809984, "matmul_bf16_tflops": 790.0,
                            "copy_bytes_per_s": 3.0e12},
            "steps": {"throughput_8b": {"status": "passed", "engine": {"model": "random Llama-3-8B",
                                                                      "model_config": hf, "decode_points": points}}}}


def test_a_gpu_check_json_recalibrates_the_row(tmp_path):
    row = hwmod.from_gpu_check(_check_doc(2e-3))
    assert row.name == "h100-measured" and row.memory == 85520809984
    assert row.flops_eff == pytest.approx(790 / 989.4) and row.bw_eff == pytest.approx(3.0 / 3.35)
    assert row.layer_overhead * 32 == pytest.approx(2e-3) and row.step_overhead == 0
    assert row.attn_eff == TABLE["h100"].attn_eff and "gpu-check" in row.source and "580.159.04" in row.source
    f = tmp_path / "check.json"
    f.write_text(json.dumps(_check_doc(0.0)))
    assert load_hardware(str(f)).layer_overhead == pytest.approx(0.0, abs=1e-12)  # --hardware takes it too
    doc = _check_doc(0.0) | {"environment": {"gpu": "NVIDIA L4", "matmul_bf16_tflops": 100.0,
                                             "copy_bytes_per_s": 2.5e11}}
    with pytest.raises(ValueError, match="no datasheet row"):
        hwmod.from_gpu_check(doc)
    assert hwmod.from_gpu_check(doc, "a100-40g").flops_eff == pytest.approx(100 / 312)
    with pytest.raises(ValueError, match="copy bandwidth"):
        hwmod.from_gpu_check(_check_doc(0.0) | {"environment": {"gpu": "NVIDIA H200", "matmul_bf16_tflops": 700.0}})


def test_calibrate_command_writes_a_row_simulate_reads(tmp_path, capsys):
    from tdpipe.cli import main

    src, row = tmp_path / "check.json", tmp_path / "row.json"
    src.write_text(json.dumps(_check_doc(1e-3)))
    assert main(["gpu-check", "calibrate", str(src), "--json", str(row)]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "h100-measured"
    assert load_hardware(str(row)).layer_overhead == pytest.approx(1e-3 / 32)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    assert main(["gpu-check", "calibrate", str(bad)]) == 2
    assert "not a gpu-check JSON" in capsys.readouterr().err
