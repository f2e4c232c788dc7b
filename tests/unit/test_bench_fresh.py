"""Fair comparisons (tdpipe.bench.fresh): every run of every side in its own process, sides alternated
(A B, B A, ...), medians and ratios read from the sides' JSON. No engine runs: the sides are a stub
program that writes a bench result (a stored one, its throughput replaced) and logs its own pid."""
import argparse
import json
import os
import sys
import textwrap

import pytest

from tdpipe.bench import fresh
from tdpipe.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THROUGHPUT_TEMPLATE = os.path.join(ROOT, "bench_results", "pp_efficiency", "throttle_pp2_amd_fp32_attn.json")
PREFIX_TEMPLATE = os.path.join(ROOT, "bench_results", "prefix", "grpo.json")


def subparser(*names: str) -> argparse.ArgumentParser:
    p = build_parser()
    for n in names:
        p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[n]
    return p


# -- order -------------------------------------------------------------------------------------------------
def test_order_alternates_abba():
    assert fresh.run_order(["A", "B"], 1) == [(0, "A"), (0, "B")]
    assert [s for _, s in fresh.run_order(["A", "B"], 4)] == list("ABBAABBA")
    assert [s for _, s in fresh.run_order(["A", "B", "C"], 2)] == list("ABCCBA")
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        fresh.run_order(["A", "B"], 0)
    with pytest.raises(ValueError, match="distinct"):
        fresh.run_order(["A", "A"], 1)


# -- the command of a side -------------------------------------------------------------------------------
def test_replay_flags_round_trip_and_overrides():
    p = subparser("bench", "throughput")
    argv = ["--num-prompts", "256", "--pp", "2", "--scheduler", "throttle", "--compare-pp1", "--json", "F",
            "--kv-cache-memory", "2GiB", "--layer-partition", "16,14", "--lm-head-split", "0.5",
            "--no-enable-prefix-caching", "--repeats", "3", "--threads-per-stage", "1"]
    a = p.parse_args(argv)
    flags = fresh.replay_flags(p, a, skip=("--json", "--repeats", "--compare-pp1"))
    assert "--json" not in flags and "--repeats" not in flags and "--compare-pp1" not in flags
    again = vars(p.parse_args(flags + ["--json", "F", "--repeats", "3", "--compare-pp1"]))
    assert {k: v for k, v in again.items() if k != "fn"} == {k: v for k, v in vars(a).items() if k != "fn"}
    assert "--future-points" not in flags  # a default given as text is still the default
    pp1 = p.parse_args(fresh.replay_flags(p, a, {"--pp": 1, "--layer-partition": None, "--threads": 2}))
    assert fresh.flag_value(p, pp1, "--pp") == 1 and fresh.flag_value(p, pp1, "--threads") == 2
    assert fresh.flag_value(p, pp1, "--layer-partition") is None
    with pytest.raises(ValueError, match="no option --nope"):
        fresh.replay_flags(p, a, {"--nope": 1})


def test_replay_flags_refuses_a_value_that_does_not_survive():
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--name", type=lambda s: s + "!", default=None)
    a = p.parse_args(["--name", "a"])
    with pytest.raises(ValueError, match="cannot replay --name"):
        fresh.replay_flags(p, a)


# -- running sides -----------------------------------------------------------------------------------------
STUB = textwrap.dedent("""
    import json, os, sys
    argv = sys.argv[1:]
    out = argv[argv.index("--json") + 1]
    side = os.environ.get("STUB_SIDE") or argv[argv.index("--side") + 1]
    log = os.environ["STUB_LOG"]
    with open(log, "a") as f:
        f.write(json.dumps({"side": side, "pid": os.getpid(), "argv": argv}) + "\\n")
    with open(log) as f:
        k = sum(1 for line in f if json.loads(line)["side"] == side) - 1
    if os.environ.get("STUB_FAIL") == side:
        sys.exit(3)
    value = json.loads(os.environ["STUB_VALUES"])[side][k]
    with open(os.environ["STUB_TEMPLATE"]) as f:
        res = json.load(f)
    res.update({"pid": os.getpid(), "output_tokens_per_s": value, "side": side})
    with open(out, "w") as f:
        json.dump(res, f)
""")


@pytest.fixture
def stub(tmp_path, monkeypatch):
    """A side program: logs (side, pid, argv), then writes the template result with the side's next value."""
    prog = tmp_path / "stub.py"
    prog.write_text(STUB)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("STUB_LOG", str(log))
    monkeypatch.setenv("STUB_TEMPLATE", THROUGHPUT_TEMPLATE)

    def read_log():
        return [json.loads(line) for line in log.read_text().splitlines()]
    return prog, read_log


def test_each_run_is_its_own_process_and_the_ratio_comes_from_the_json(stub, monkeypatch):
    prog, read_log = stub
    monkeypatch.setenv("STUB_VALUES", json.dumps({"A": [100.0, 90.0, 110.0, 95.0], "B": [80.0, 100.0, 100.0, 70.0]}))

    def command(side, repeat, out, done):
        assert [r.side for r in done][:1] in ([], ["A"])  # the first side's first run always comes first
        return [sys.executable, str(prog), "--side", side, "--json", out]

    runs = fresh.run_sides(["A", "B"], 4, command, describe=lambda r: f"{r.result['output_tokens_per_s']}")
    log = read_log()
    assert [r.side for r in runs] == [x["side"] for x in log] == list("ABBAABBA")
    pids = [r.pid for r in runs]
    assert len(set(pids)) == 8 and os.getpid() not in pids
    assert pids == [x["pid"] for x in log] == [r.result["pid"] for r in runs]  # Popen's pid is the side's own
    tok = lambda r: r["output_tokens_per_s"]  # noqa: E731
    c = fresh.compare(runs, "A", "B", tok)
    assert c["values"] == [100.0, 90.0, 110.0, 95.0] and c["base_values"] == [80.0, 100.0, 100.0, 70.0]
    assert c["median"] == 95.0 and c["base_median"] == 80.0  # the lower middle: one run's figure
    assert c["ratio"] == pytest.approx(95.0 / 80.0)
    assert c["ratio_per_repeat"] == pytest.approx([100 / 80, 90 / 100, 110 / 100, 95 / 70])
    assert fresh.median_run(runs, "A", tok).result["output_tokens_per_s"] == 95.0
    m = fresh.method(["A", "B"], 4, runs)
    assert m["order"][:4] == ["A#1", "B#1", "B#2", "A#2"] and [x["pid"] for x in m["runs"]] == pids


def test_a_failed_side_names_the_command(stub, monkeypatch):
    prog, _ = stub
    monkeypatch.setenv("STUB_FAIL", "B")
    monkeypatch.setenv("STUB_VALUES", json.dumps({"A": [1.0], "B": [1.0]}))
    with pytest.raises(fresh.SideFailed, match="side 'B' .* exit code 3; run it alone: .*stub.py --side B"):
        fresh.run_sides(["A", "B"], 1, lambda s, r, out, d: [sys.executable, str(prog), "--side", s, "--json", out])


def test_different_work_is_refused():
    runs = [fresh.SideRun("A", 0, 1, 0.0, [], {"workload": {"seed": 0}}),
            fresh.SideRun("B", 0, 2, 0.0, [], {"workload": {"seed": 1}})]
    with pytest.raises(fresh.SideFailed, match="different work"):
        fresh.check_same_work(runs, lambda r: r["workload"])
    fresh.check_same_work(runs[:1] * 2, lambda r: r["workload"])


# -- the benches, with the stub as their side program ---------------------------------------------------------
@pytest.fixture
def stub_cli(stub, monkeypatch):
    """Sides that `tdpipe bench ...` starts run the stub; the side is told by its flags."""
    prog, read_log = stub
    monkeypatch.setattr(fresh, "CLI", [sys.executable, str(prog)])
    return read_log


def test_compare_pp1_runs_both_sides_fresh_and_alternated(stub_cli, monkeypatch, tmp_path, capsys):
    # the stub tells the sides apart by their flags: pp = 1 has no --pp (the default) and gets --threads
    wrapper = tmp_path / "sides.py"
    wrapper.write_text(textwrap.dedent(f"""
        import os, sys
        os.environ["STUB_SIDE"] = "pp1" if "--pp" not in sys.argv else "pp2"
        exec(open({str(tmp_path / 'stub.py')!r}).read())
    """))
    monkeypatch.setattr(fresh, "CLI", [sys.executable, str(wrapper)])
    monkeypatch.setenv("STUB_VALUES", json.dumps({"pp2": [60.0, 64.0, 62.0], "pp1": [61.0, 66.0, 65.0]}))
    out = tmp_path / "res.json"
    assert main(["bench", "throughput", "--num-prompts", "256", "--pp", "2", "--scheduler", "throttle",
                 "--compare-pp1", "--repeats", "3", "--json", str(out)]) == 0
    log = stub_cli()
    assert [x["side"] for x in log] == ["pp2", "pp1", "pp1", "pp2", "pp2", "pp1"]
    assert len({x["pid"] for x in log}) == 6 and os.getpid() not in {x["pid"] for x in log}
    pp1_argv = next(x["argv"] for x in log if x["side"] == "pp1")
    assert pp1_argv[pp1_argv.index("--threads") + 1] == "2"  # the template's threads: all of pp = 2's
    assert "--lm-head-split" in pp1_argv and "--compare-pp1" not in pp1_argv and "--repeats" not in pp1_argv
    res = json.loads(out.read_text())
    assert res["output_tokens_per_s"] == 62.0 and res["pp1_output_tokens_per_s"] == 65.0
    assert res["ratio_vs_pp1"] == pytest.approx(62.0 / 65.0)
    assert res["ratio_vs_pp1_per_repeat"] == pytest.approx([60 / 61, 64 / 66, 62 / 65])
    assert res["output_tokens_per_s_runs"] == [60.0, 64.0, 62.0]
    cmp = res["comparison"]
    assert cmp["order"] == ["engine#1", "pp1#1", "pp1#2", "engine#2", "engine#3", "pp1#3"]
    assert cmp["pp1"]["pids"] != cmp["pp1"]["base_pids"]
    table = capsys.readouterr().out
    assert "ratio vs pp=1      0.954x" in table and "each run in its own process" in table


def test_machine_states_the_isa():
    from tdpipe.bench.machine import ISA_FLAGS, describe, machine_info

    m = machine_info()
    assert m["cpu"] and m["usable_cores"] >= 1 and set(m["isa"]) <= set(ISA_FLAGS)
    line = describe(m)
    assert m["cpu"] in line and "usable cores" in line and all(x in line for x in m["isa"])


def test_compare_pp1_needs_a_pipeline(capsys):
    assert main(["bench", "throughput", "--compare-pp1"]) == 2
    assert "--compare-pp1 needs --pp > 1" in capsys.readouterr().err
    assert main(["bench", "throughput", "--repeats", "2"]) == 2
    assert "--repeats applies to the --compare-* flags" in capsys.readouterr().err


def test_bench_prefix_runs_each_row_fresh(stub_cli, monkeypatch, tmp_path, capsys):
    template = json.loads(open(PREFIX_TEMPLATE).read())
    rows = {r["row"]: r for r in template["rows"]}
    wrapper = tmp_path / "rows.py"
    # a row's process: the stored grpo result cut to the row it was asked for, its throughput replaced
    wrapper.write_text(textwrap.dedent(f"""
        import json, os, sys
        argv = sys.argv[1:]
        side = argv[argv.index("--rows") + 1]
        assert "--in-process" in argv and "--repeats" not in argv
        out = argv[argv.index("--json") + 1]
        log = os.environ["STUB_LOG"]
        with open(log, "a") as f:
            f.write(json.dumps({{"side": side, "pid": os.getpid(), "argv": argv}}) + "\\n")
        k = sum(1 for line in open(log) if json.loads(line)["side"] == side) - 1
        res = json.load(open({PREFIX_TEMPLATE!r}))
        row = [r for r in res["rows"] if r["row"] == side][0]
        row["output_tokens_per_s"] = json.loads(os.environ["STUB_VALUES"])[side][k]
        res["rows"] = [row]
        json.dump(res, open(out, "w"))
    """))
    monkeypatch.setattr(fresh, "CLI", [sys.executable, str(wrapper)])
    monkeypatch.setenv("STUB_VALUES", json.dumps({"no-sharing": [300.0, 330.0], "fork": [600.0, 630.0],
                                                  "fork-cache": [640.0, 600.0]}))
    out = tmp_path / "p.json"
    assert main(["bench", "prefix", "--workload", "grpo", "--repeats", "2", "--json", str(out)]) == 0
    log = stub_cli()
    assert [x["side"] for x in log] == ["no-sharing", "fork", "fork-cache", "fork-cache", "fork", "no-sharing"]
    assert len({x["pid"] for x in log}) == 6
    res = json.loads(out.read_text())
    got = {r["row"]: r for r in res["rows"]}
    assert list(got) == ["no-sharing", "fork", "fork-cache"] and res["baseline"] == "no-sharing"
    assert got["fork"]["ratio_vs_baseline"] == pytest.approx(600.0 / 300.0)
    assert got["fork-cache"]["output_tokens_per_s_runs"] == [640.0, 600.0]
    assert got["fork"]["prefill_tokens_computed"] == rows["fork"]["prefill_tokens_computed"]
    assert res["comparison"]["vs_baseline"]["fork"]["ratio_per_repeat"] == pytest.approx([2.0, 630 / 330])
    assert res["command"].startswith("tdpipe bench prefix --workload grpo")
    assert "medians of 2 runs per row" in capsys.readouterr().out


def test_bench_layouts_repeats_rows_alternated(stub_cli, monkeypatch, tmp_path, capsys):
    wrapper = tmp_path / "layouts.py"
    wrapper.write_text(textwrap.dedent(f"""
        import os, sys
        argv = sys.argv[1:]
        os.environ["STUB_SIDE"] = argv[argv.index("--pp") + 1] + "x" + argv[argv.index("--tp") + 1]
        exec(open({str(tmp_path / 'stub.py')!r}).read())
    """))
    monkeypatch.setattr(fresh, "CLI", [sys.executable, str(wrapper)])
    monkeypatch.setenv("STUB_VALUES", json.dumps({"1x1": [100.0, 120.0, 110.0], "2x1": [90.0, 99.0, 88.0]}))
    out = tmp_path / "l.json"
    assert main(["bench", "layouts", "--rows", "1x1:hybrid,2x1:throttle", "--repeats", "3", "--json",
                 str(out)]) == 0
    assert [x["side"] for x in stub_cli()] == ["1x1", "2x1", "2x1", "1x1", "1x1", "2x1"]
    res = json.loads(out.read_text())
    assert [t["output_tokens_per_s"] for t in res["table"]] == [110.0, 90.0]
    assert res["table"][1]["ratio"] == pytest.approx(90.0 / 110.0)
    assert "3 runs per row in alternating order" in capsys.readouterr().out
