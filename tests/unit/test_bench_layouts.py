"""`tdpipe bench layouts`: row parsing and naming (TD-Pipe §4.2's TP+SB ... TD-Pipe), the command each row
runs, and the table built from the rows' bench JSON (all-reduce share from the trace figures)."""
import argparse

import pytest

from tdpipe.bench import layouts as L


def test_rows_and_names():
    rows = L.parse_rows(L.DEFAULT_ROWS)
    assert [(r.pp, r.tp, r.policy) for r in rows][:3] == [(1, 1, "hybrid"), (1, 2, "separate"), (1, 2, "hybrid")]
    assert [r.name for r in rows] == ["1 process (hybrid)", "TP+SB", "TP+HB", "PP+SB", "PP+HB", "TD-Pipe",
                                      "gLLM throttle"]
    assert L.Row(2, 2, "separate").name == "PP2xTP+SB"


@pytest.mark.parametrize("spec,msg", [("2x1", "expected PxT:policy"), ("2y1:hybrid", "expected PxT:policy"),
                                      ("0x1:hybrid", "P and T must be >= 1"), ("1x1:nope", "unknown policy 'nope'"),
                                      (" , ", "--rows is empty")])
def test_bad_rows_name_the_item(spec, msg):
    with pytest.raises(ValueError, match=msg):
        L.parse_rows(spec)


def test_row_command_passes_the_workload():
    a = argparse.Namespace(dtype="bfloat16", num_prompts=64, workload_seed=3, model="random:qwen2.5-0.5b",
                           input_len=None, output_len=None, dataset=None, history=None, kv_cache_memory="2GiB",
                           max_num_seqs=None, max_num_batched_tokens=None, workload="sharegpt",
                           history_split="test")
    cmd = L._row_cmd(a, L.Row(1, 2, "hybrid"), "out.json")
    s = " ".join(cmd)
    assert "bench throughput --pp 1 --tp 2 --scheduler hybrid" in s and "--json out.json" in s
    assert "--model random:qwen2.5-0.5b" in s and "--kv-cache-memory 2GiB" in s and "--workload-seed 3" in s
    assert "--max-num-seqs" not in s and "--workload" not in s.replace("--workload-seed", "")


def _result(pp, tp, policy, tok_s, allreduce=None):
    busy = [10.0] * pp
    return {"row": L.Row(pp, tp, policy).name, "pp": pp, "tp": tp, "policy": policy,
            "output_tokens_per_s": tok_s, "elapsed_s": 100.0 / tok_s, "bubble_ratio_per_stage": [0.1] * pp,
            "busy_s_per_stage": busy, "allreduce_s_per_stage": allreduce or [0.0] * pp,
            "allreduce_ms_per_step": [x * 2 for x in (allreduce or [0.0] * pp)], "preemptions": 0,
            "workload": {"name": "sharegpt", "seed": 0, "input_mean": 200, "output_mean": 180},
            "machine": {"cpu": "test cpu"}, "num_requests": 8, "model": "m", "threads": 2, "dtype": "bfloat16"}


def test_table_ratios_and_allreduce_share():
    res = [_result(1, 1, "hybrid", 100.0), _result(1, 2, "separate", 80.0, [2.5]), _result(2, 1, "td-pipe", 125.0)]
    t = L.summarize(res)
    assert [round(x["ratio"], 3) for x in t] == [1.0, 0.8, 1.25]
    assert t[1]["allreduce_share_of_busy"] == [0.25] and t[2]["allreduce_share_of_busy"] == [0.0, 0.0]
    text = L.format_table(t, res[0])
    assert "TP+SB" in text and "0.80x" in text and "(25%)" in text and "TD-Pipe" in text and "1.25x" in text
