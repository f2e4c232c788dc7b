"""Benchmark workloads and the MFU FLOP formula: no model needed, except one opt-in end-to-end smoke test."""
import argparse
import json

import pytest

from tdpipe.bench import workload as wl
from tdpipe.bench.peak import measure_matmul_peak
from tdpipe.bench.throughput import Flops, build_workload, hf_batches, request_flops, workload_flops
from tdpipe.config import ModelConfig


def tiny_config(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2,
                num_heads=2, num_kv_heads=1, head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False)
    base.update(kw)
    return ModelConfig(**base)


# -- workloads -----------------------------------------------------------------------------------------
def test_fixed_shapes_and_determinism():
    a = wl.fixed(5, 7, 3, vocab_size=1000, seed=1)
    b = wl.fixed(5, 7, 3, vocab_size=1000, seed=1)
    c = wl.fixed(5, 7, 3, vocab_size=1000, seed=2)
    assert a == b and a != c
    assert all(r.input_len == 7 and r.output_len == 3 for r in a)
    assert all(wl.FIRST_ORDINARY_ID <= t < 1000 for r in a for t in r.prompt_token_ids)


def test_fixed_rejects_bad_lengths():
    with pytest.raises(ValueError, match="input_len"):
        wl.fixed(2, 0, 3, vocab_size=1000)


def test_sharegpt_deterministic_and_clipped():
    a = wl.sharegpt_like(300, vocab_size=49152, seed=3, max_model_len=512, max_input=300, max_output=200)
    assert a == wl.sharegpt_like(300, vocab_size=49152, seed=3, max_model_len=512, max_input=300, max_output=200)
    assert a != wl.sharegpt_like(300, vocab_size=49152, seed=4, max_model_len=512, max_input=300, max_output=200)
    for r in a:
        assert 4 <= r.input_len <= 300
        assert 4 <= r.output_len <= 200
        assert r.input_len + r.output_len <= 512
        assert all(wl.FIRST_ORDINARY_ID <= t < 49152 for t in r.prompt_token_ids)
    assert max(r.input_len for r in a) == 300  # the tail reaches the cap at this size


def test_sharegpt_short_context_fits():
    reqs = wl.sharegpt_like(500, vocab_size=1000, seed=0, max_model_len=64)
    assert all(4 <= r.input_len <= 60 and 4 <= r.output_len and r.input_len + r.output_len <= 64 for r in reqs)


def test_sharegpt_matches_documented_statistics():
    s = wl.summarize(wl.sharegpt_like(20000, vocab_size=1000, seed=0, max_model_len=2048))
    assert abs(s["input_mean"] - 224) < 10 and abs(s["output_mean"] - 188) < 8
    assert abs(s["input_median"] - 145) < 8 and abs(s["output_median"] - 119) < 8
    assert s["input_max"] <= 1024 and s["output_max"] <= 1024


class FakeTok:
    def encode(self, text, add_special_tokens=True):
        return [1] + [len(w) + 100 for w in text.split()]


def write(tmp_path, lines):
    p = tmp_path / "w.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_jsonl_reads_both_forms(tmp_path):
    p = write(tmp_path, ['{"prompt": "a bb ccc", "output_len": 5}', "",
                         '{"prompt_token_ids": [7, 8], "max_tokens": 2}', '{"prompt": "x", "output_len": 1}'])
    reqs = wl.from_jsonl(p, FakeTok())
    assert reqs == [wl.BenchRequest([1, 101, 102, 103], 5, "a bb ccc"), wl.BenchRequest([7, 8], 2),
                    wl.BenchRequest([1, 101], 1, "x")]
    assert len(wl.from_jsonl(p, FakeTok(), limit=2)) == 2


@pytest.mark.parametrize("line, msg", [
    ('{"output_len": 3}', r"w.jsonl:2: missing field 'prompt' or 'prompt_token_ids'"),
    ('{"prompt": "hi"}', r"w.jsonl:2: missing field 'output_len'"),
    ('{"prompt": "hi", "output_len": 0}', r"w.jsonl:2: 'output_len' must be an integer >= 1"),
    ('{"prompt_token_ids": [], "output_len": 3}', r"w.jsonl:2: 'prompt_token_ids' must be a non-empty"),
    ('{"prompt": 5, "output_len": 3}', r"w.jsonl:2: 'prompt' must be a string"),
    ("not json", r"w.jsonl:2: not valid JSON"),
    ("[1, 2]", r"w.jsonl:2: expected a JSON object"),
])
def test_jsonl_errors_name_line_and_field(tmp_path, line, msg):
    p = write(tmp_path, ['{"prompt": "ok", "output_len": 1}', line])
    with pytest.raises(ValueError, match=msg):
        wl.from_jsonl(p, FakeTok())


def test_jsonl_empty(tmp_path):
    with pytest.raises(ValueError, match="no requests"):
        wl.from_jsonl(write(tmp_path, [""]), FakeTok())


# -- workload selection ------------------------------------------------------------------------------------
def ns(**kw):
    base = dict(num_prompts=4, input_len=None, output_len=None, dataset=None, workload="sharegpt", workload_seed=0,
                history=None, history_split="test")
    base.update(kw)
    return argparse.Namespace(**base)


def test_build_workload_selection():
    name, reqs = build_workload(ns(input_len=5, output_len=3), 1000, 64)
    assert name == "fixed" and all(r.input_len == 5 and r.output_len == 3 for r in reqs)
    with pytest.raises(ValueError, match="both --input-len and --output-len"):
        build_workload(ns(workload="fixed", input_len=5), 1000, 64)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        build_workload(ns(input_len=60, output_len=5), 1000, 64)
    name, reqs = build_workload(ns(), 1000, 4096)
    assert name == "sharegpt" and len(reqs) == 4
    assert all(r.input_len + r.output_len <= 2048 for r in reqs)  # vLLM's ShareGPT cap


def test_build_workload_dataset_too_long(tmp_path):
    p = write(tmp_path, ['{"prompt_token_ids": [5, 6, 7], "output_len": 62}'])
    with pytest.raises(ValueError, match="request 0: 3 prompt \\+ 62 output tokens"):
        build_workload(ns(dataset=str(p)), 1000, 64, FakeTok())


def test_hf_batches_group_equal_output_lengths():
    reqs = [wl.BenchRequest([1] * i, o) for i, o in [(3, 8), (2, 4), (5, 8), (1, 4), (4, 2)]]
    assert hf_batches(reqs, 2) == [[4, 3], [1, 0], [2]]


# -- FLOP formula --------------------------------------------------------------------------------------
def test_request_flops_by_hand():
    mc = tiny_config()
    # params_per_token_flops: h*(q+2kv) + q*h + 3*h*i = 4*(4+4) + 4*4 + 3*4*8 = 144 per layer; x2 x2 layers
    assert mc.params_per_token_flops() == 576
    # 3 prompt tokens, 2 outputs: processed = 3 + 2 - 1 = 4 tokens at positions 0..3 -> contexts 1+2+3+4 = 10
    f = request_flops(mc, 3, 2)
    assert f.linear == 4 * 576
    assert f.attention == 10 * 4 * 2 * 2 * 2  # context * 4 * heads * head_dim * layers
    assert f.lm_head == 2 * 2 * 4 * 10  # two sampled tokens * 2 * hidden * vocab
    assert f.total == 2304 + 320 + 160


def test_request_flops_prefill_only_and_sum():
    mc = tiny_config()
    f = request_flops(mc, 1, 1)  # one token at position 0, one sampled token
    assert f == Flops(576, 1 * 32, 80)
    assert workload_flops(mc, [(3, 2), (1, 1)]).total == request_flops(mc, 3, 2).total + f.total
    with pytest.raises(ValueError):
        request_flops(mc, 0, 1)


def test_peak_positive():
    import torch

    assert measure_matmul_peak(torch.float32, n=64, seconds=0.05) > 0


@pytest.mark.slow  # starts a Python process that imports torch
def test_peak_in_a_fresh_process():
    import torch

    from tdpipe.bench.peak import measure_matmul_peak_fresh

    # float32: a bf16 2048^3 matmul is emulated on CPUs without bf16 instructions and took over 6 minutes
    assert measure_matmul_peak_fresh(torch.float32, 1) > 0


# -- end to end (tiny random model) ---------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_throughput_end_to_end(tmp_path):
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tdpipe.cli import main
    from tdpipe.model.bundled import bundled_model_path

    src = bundled_model_path()
    model_dir = tmp_path / "tiny"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", model_dir / name)
    out = tmp_path / "res.json"
    rc = main(["bench", "throughput", "--model", str(model_dir), "--dtype", "float32", "--input-len", "8",
               "--output-len", "4", "--num-prompts", "4", "--num-kv-blocks", "64", "--threads", "1",
               "--compare-hf", "--hf-batch-size", "2", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    for k in ("requests_per_s", "input_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s", "mfu",
              "hf_output_tokens_per_s", "ratio_vs_hf", "peak_gflops", "elapsed_s"):
        assert res[k] > 0, k
    assert res["num_requests"] == 4 and res["total_output_tokens"] == 16 and res["total_input_tokens"] == 32
    assert len(res["peak_probes_gflops"]) == 2 and res["peak_gflops"] == max(res["peak_probes_gflops"])


class ChatTok(FakeTok):
    def apply_chat_template(self, conv, tokenize=False, add_generation_prompt=True):
        assert not tokenize and add_generation_prompt and conv[-1]["role"] == "user"
        return "<u> " + conv[-1]["content"] + " <a>"


def test_history_replay_uses_the_predictor_split(tmp_path):
    from tdpipe.predictor.history import HistoryRecord, HistoryWriter
    from tdpipe.predictor.train import split

    path = str(tmp_path / "h.jsonl")
    w = HistoryWriter(path, model="m")
    recs = [HistoryRecord(f"prompt {i}", 3, 1 + i % 7, "stop") for i in range(20)]
    for r in recs:
        w.write(r)
    w.close()
    test = wl.from_history(path, ChatTok(), "test")
    held_out = split(recs, 0)[2]
    assert [r.text for r in test] == [r.prompt for r in held_out]
    assert [r.output_len for r in test] == [r.output_tokens for r in held_out]
    assert len(wl.from_history(path, ChatTok(), "all")) == 20
    name, reqs = build_workload(ns(history=path, history_split="train", num_prompts=5), 1000, 64, ChatTok())
    assert name.startswith("history:") and len(reqs) == 5 and reqs[0].input_len > 0
    with pytest.raises(ValueError, match="drop --dataset"):
        build_workload(ns(history=path, history_split="all", dataset=path), 1000, 64, ChatTok())
    with pytest.raises(ValueError, match="history split"):
        wl.from_history(path, ChatTok(), "dev")


def test_compare_pp1_drops_layout_only_settings():
    """--compare-pp1 with --lm-head-split used to pass the split to the pp = 1 engine, which refused it
    after the whole pipeline run had been spent. The pp = 1 side's command drops every layout-only setting
    and takes all the pipeline workers' threads."""
    import argparse

    from tdpipe.bench import fresh
    from tdpipe.bench.throughput import side_command
    from tdpipe.cli import build_parser
    from tdpipe.entrypoints.llm import engine_config

    root = build_parser()
    p = next(x for x in root._actions if isinstance(x, argparse._SubParsersAction)).choices["bench"]
    p = next(x for x in p._actions if isinstance(x, argparse._SubParsersAction)).choices["throughput"]
    a = p.parse_args(["--pp", "2", "--lm-head-split", "0.5", "--layer-partition", "16,14", "--compare-pp1",
                      "--threads-per-stage", "1", "--trace", "t.json"])
    engine_run = fresh.SideRun("engine", 0, 1, 0.0, [], {"threads": 2})
    argv = side_command(a, p, "pp1", "out.json", [engine_run])
    assert argv[argv.index("bench"):][:2] == ["bench", "throughput"] and argv[-2:] == ["--json", "out.json"]
    b = p.parse_args(argv[argv.index("throughput") + 1:])
    assert fresh.flag_value(p, b, "--pp") == 1 and fresh.flag_value(p, b, "--lm-head-split") == 0.0
    assert fresh.flag_value(p, b, "--layer-partition") is None and fresh.flag_value(p, b, "--trace") is None
    assert fresh.flag_value(p, b, "--threads") == 2 and fresh.flag_value(p, b, "--threads-per-stage") is None
    assert not b.compare_pp1
    from tdpipe.entrypoints.args import engine_kwargs

    assert engine_config(engine_kwargs(b)).parallel.pipeline_parallel_size == 1  # a config that validates
