"""`tdpipe bench prefix`: workload shapes and determinism, flag errors (no model), one tiny end-to-end run."""
import json
import os

import pytest

from tdpipe.bench import prefix as bp
from tdpipe.bench import workload as wl
from tdpipe.cli import build_parser, main

VOCAB = 49152


# -- workloads -----------------------------------------------------------------------------------------
def test_grpo_shape_and_determinism():
    a = wl.grpo(64, VOCAB, seed=0)
    assert a == wl.grpo(64, VOCAB, seed=0) and a != wl.grpo(64, VOCAB, seed=1)
    assert len(a) == 64
    assert all(448 <= r.input_len <= 576 for r in a)
    assert len({r.input_len for r in a}) > 10  # spread, not one shape
    assert all(r.n == 8 and r.output_len == 256 and r.temperature == 1.0 for r in a)
    assert len({r.seed for r in a}) == 64 and all(r.seed is not None for r in a)
    assert len({tuple(r.prompt_token_ids) for r in a}) == 64
    assert all(wl.FIRST_ORDINARY_ID <= t < VOCAB for r in a for t in r.prompt_token_ids)


def test_grpo_small_and_errors():
    a = wl.grpo(2, VOCAB, seed=3, input_len=40, n=2, output_len=4)
    assert all(35 <= r.input_len <= 45 and r.n == 2 and r.output_len == 4 for r in a)
    with pytest.raises(ValueError, match="n and output_len"):
        wl.grpo(2, VOCAB, n=0)


def test_split_samples_seeds():
    a = wl.grpo(3, VOCAB, seed=0, input_len=16, n=4, output_len=2)
    s = wl.split_samples(a)
    assert len(s) == 12
    for k, r in enumerate(a):
        group = s[4 * k: 4 * k + 4]
        assert all(x.prompt_token_ids == r.prompt_token_ids and x.n == 1 and x.output_len == 2
                   and x.temperature == 1.0 for x in group)
        assert [x.seed for x in group] == [r.seed * 4 + i for i in range(4)]


def test_shared_prefix_shape_and_determinism():
    a = wl.shared_prefix(1000, VOCAB, seed=0)
    assert a == wl.shared_prefix(1000, VOCAB, seed=0) and a != wl.shared_prefix(1000, VOCAB, seed=1)
    prefix = a[0].prompt_token_ids[:1024]
    assert all(r.prompt_token_ids[:1024] == prefix for r in a)
    qs = [tuple(r.prompt_token_ids[1024:]) for r in a]
    assert all(16 <= len(q) <= 48 for q in qs) and len(set(qs)) == 1000
    assert all(r.n == 1 and r.output_len == 32 and r.temperature == 0.0 for r in a)


def test_shared_prefix_distinct_questions_even_when_few_exist():
    # a vocabulary of 60 holds only 60 one-token questions: 50 distinct ones need redraws
    a = wl.shared_prefix(50, 60, seed=0, prefix_len=4, question_len=(1, 1), output_len=2)
    assert len({tuple(r.prompt_token_ids[4:]) for r in a}) == 50
    with pytest.raises(ValueError, match="distinct questions"):
        wl.shared_prefix(61, 60, prefix_len=4, question_len=(1, 1))
    with pytest.raises(ValueError, match="question_len"):
        wl.shared_prefix(5, VOCAB, question_len=(8, 4))


# -- flags -----------------------------------------------------------------------------------------------
def args(*argv):
    return build_parser().parse_args(["bench", "prefix", *argv])


def test_defaults_are_the_issue_bar():
    p, rows = bp.check_args(args("--workload", "grpo"))
    assert p == {"name": "grpo", "seed": 0, "num_prompts": 64, "input_len": 512, "n": 8, "output_len": 256}
    assert [r.name for r in rows] == ["no-sharing", "fork", "fork-cache"]
    assert [(r.split, r.caching) for r in rows] == [(True, False), (False, False), (False, True)]
    p, rows = bp.check_args(args("--workload", "shared-prefix"))
    assert p == {"name": "shared-prefix", "seed": 0, "num_prompts": 1000, "prefix_len": 1024,
                 "question_len": (16, 48), "output_len": 32}
    assert [(r.name, r.caching) for r in rows] == [("cache-off", False), ("cache-on", True)]
    _, rows = bp.check_args(args("--workload", "grpo", "--rows", "fork-cache,no-sharing-cache"))
    assert [r.name for r in rows] == ["fork-cache", "no-sharing-cache"]


@pytest.mark.parametrize("argv, flag", [
    (["--workload", "grpo", "--prefix-len", "8"], "--prefix-len applies to --workload shared-prefix"),
    (["--workload", "shared-prefix", "--n", "2"], "--n applies to --workload grpo"),
    (["--workload", "shared-prefix", "--input-len", "9"], "--input-len applies"),
    (["--workload", "grpo", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--workload", "grpo", "--n", "0"], "--n must be >= 1"),
    (["--workload", "shared-prefix", "--output-len", "0"], "--output-len must be >= 1"),
    (["--workload", "shared-prefix", "--question-len", "9,3"], "--question-len must be"),
    (["--workload", "grpo", "--rows", "cache-on"], "--rows 'cache-on': unknown cache-on"),
    (["--workload", "grpo", "--rows", "fork,fork"], "--rows 'fork,fork': a row is named twice"),
    (["--workload", "grpo", "--enable-prefix-caching"], "--enable-prefix-caching"),
    (["--workload", "grpo", "--no-enable-prefix-caching"], "each row sets caching itself"),
])
def test_flag_errors_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag.replace("(", r"\(")):
        bp.check_args(args(*argv))


def test_flag_errors_exit_2_before_loading(capsys):
    assert main(["bench", "prefix", "--workload", "grpo", "--prefix-len", "8"]) == 2
    assert "--prefix-len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "prefix", "--workload", "grpo", "--question-len", "x"])


def test_too_long_for_the_model_is_refused():
    p, _ = bp.check_args(args("--workload", "shared-prefix", "--prefix-len", "100", "--num-prompts", "2"))
    with pytest.raises(ValueError, match="max_model_len is 64"):
        bp.build_workload(p, VOCAB, 64)


def test_submissions_split_and_fork():
    reqs = wl.grpo(2, VOCAB, seed=0, input_len=8, n=3, output_len=2)
    prompts, params, owner = bp.submissions(reqs, split=True)
    assert len(prompts) == 6 and owner == [0, 0, 0, 1, 1, 1]
    assert all(sp.n == 1 and sp.ignore_eos and sp.max_tokens == 2 and sp.temperature == 1.0 for sp in params)
    assert [sp.seed for sp in params[:3]] == [reqs[0].seed * 3 + i for i in range(3)]
    prompts, params, owner = bp.submissions(reqs, split=False)
    assert len(prompts) == 2 and owner == [0, 1] and [sp.n for sp in params] == [3, 3]
    assert [sp.seed for sp in params] == [r.seed for r in reqs]


def test_command_line_reproduces_the_flags():
    import argparse

    root = argparse.ArgumentParser()
    parser = bp.add_parser(root.add_subparsers())
    a = root.parse_args(["prefix", "--workload", "shared-prefix", "--prefix-len", "32", "--pp", "2",
                         "--question-len", "4,8", "--json", "x.json"])
    cmd = bp.command_line(a, parser)
    assert cmd.startswith("tdpipe bench prefix --workload shared-prefix")
    for part in ("--prefix-len 32", "--question-len 4,8", "--pp 2", "--json x.json"):
        assert part in cmd
    assert "--n " not in cmd and "--num-prompts" not in cmd
    again = vars(root.parse_args(cmd.split()[2:]))
    assert {k: v for k, v in again.items() if k != "fn"} == {k: v for k, v in vars(a).items() if k != "fn"}


# -- end to end (bundled model) ------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_prefix_end_to_end(tmp_path, bundled_path):
    common = ["--model", bundled_path, "--dtype", "float32", "--num-kv-blocks", "128", "--threads", "1"]
    # grpo: the rows in this one process (--in-process, what each row's own process does: saves three
    # process start-ups); shared-prefix below: each row in a fresh process, as the command runs by default
    g = tmp_path / "grpo.json"
    assert main(["bench", "prefix", "--workload", "grpo", "--num-prompts", "2", "--n", "2",
                 "--input-len", "40", "--output-len", "4", "--in-process", "--json", str(g), *common]) == 0
    res = json.loads(g.read_text())
    assert res["command"].startswith("tdpipe bench prefix --workload grpo")
    assert res["machine"]["cpu_count"] >= 1 and res["workload"]["n"] == 2 and res["baseline"] == "no-sharing"
    assert [r["row"] for r in res["rows"]] == ["no-sharing", "fork", "fork-cache"]
    rows = {r["row"]: r for r in res["rows"]}
    assert rows["no-sharing"]["submitted_requests"] == 4 and rows["fork"]["submitted_requests"] == 2
    for r in res["rows"]:
        assert r["elapsed_s"] > 0 and r["output_tokens_per_s"] > 0 and r["ratio_vs_baseline"] > 0
        assert r["total_output_tokens"] == 2 * 2 * 4 and r["num_samples"] == 4 and r["complete"], r["row"]
    assert rows["no-sharing"]["ratio_vs_baseline"] == 1.0
    assert rows["no-sharing"]["prefix_cache"]["hit_rate"] == 0 and rows["fork"]["prefix_cache"]["hits"] == 0
    # fork prefills each prompt once; the split row twice
    assert rows["fork"]["prefill_tokens_computed"] < rows["no-sharing"]["prefill_tokens_computed"]

    # a prompt finds in the cache only blocks computed in an earlier step: a 64-token budget admits one
    # 36-40-token prompt at a time, so the first computes the prefix and the others can reuse it (with the
    # default budget all six would be prefilled in one step, as the first ~7 of the full-size run are)
    s = tmp_path / "shared.json"
    assert main(["bench", "prefix", "--workload", "shared-prefix", "--num-prompts", "6", "--prefix-len", "32",
                 "--question-len", "4,8", "--output-len", "3", "--max-model-len", "64",
                 "--max-num-batched-tokens", "64", "--json", str(s), *common]) == 0
    res = json.loads(s.read_text())
    rows = {r["row"]: r for r in res["rows"]}
    assert list(rows) == ["cache-off", "cache-on"] and res["baseline"] == "cache-off"
    assert [r["side"] for r in res["comparison"]["runs"]] == ["cache-off", "cache-on"]
    assert len({r["pid"] for r in res["comparison"]["runs"]} | {os.getpid()}) == 3  # two fresh processes
    off, on = rows["cache-off"], rows["cache-on"]
    assert off["complete"] and on["complete"]
    assert off["total_output_tokens"] == on["total_output_tokens"] == 18
    assert off["prefix_cache"]["hit_rate"] == 0 and off["prefix_cache"]["hits"] == 0
    assert on["prefix_cache"]["hit_rate"] > 0 and on["prefix_cache"]["cached_tokens"] > 0
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
