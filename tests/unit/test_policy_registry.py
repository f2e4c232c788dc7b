"""The policy registry: every policy registers itself (knobs included), and make_scheduler, EngineArgs and the
CLI read it; the CLI's defaults are EngineArgs' and the knobs' own. Unit tests, no model."""
import argparse
import dataclasses
import subprocess
import sys

import pytest

from tdpipe.config import EngineConfig, SchedulerConfig
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler import (HybridScheduler, SeparateScheduler, TDPipeScheduler, ThrottleScheduler,
                                   make_scheduler, registry)
from tdpipe.core.scheduler.registry import (PolicyStat, get_policy, knob_owners, policies, policy_names,
                                            register_policy, scheduler_config)
from tdpipe.core.scheduler.td_pipe import TDPipeKnobs
from tdpipe.core.scheduler.throttle import ThrottleKnobs
from tdpipe.core.scheduler.vllm_pp import VllmPPScheduler
from tdpipe.engine_args import EngineArgs
from tdpipe.ignored_args import IGNORED
from tdpipe.cli import build_parser
from tdpipe.options import flagged, option

BUILTIN = {"separate": (SeparateScheduler, 8192), "hybrid": (HybridScheduler, 512),
           "throttle": (ThrottleScheduler, 2048 + 256), "td-pipe": (TDPipeScheduler, 2048),
           "vllm-pp": (VllmPPScheduler, 8192)}


@pytest.fixture
def isolated_registry(monkeypatch):
    """Policies registered in a test vanish after it."""
    monkeypatch.setattr(registry, "_POLICIES", dict(registry._POLICIES))


@pytest.fixture(autouse=True)
def wide_help(monkeypatch):
    """argparse wraps help at the terminal's width, which may split 'td-pipe' at its hyphen."""
    monkeypatch.setenv("COLUMNS", "10000")


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("name", list(BUILTIN))
def test_builtin_policy_registered_with_its_budget(name):
    cls, budget = BUILTIN[name]
    spec = get_policy(name)
    assert spec.name == name and spec.cls is cls and spec.default_token_budget == budget
    cfg = scheduler_config(policy=name)
    assert cfg.max_num_batched_tokens == budget
    assert scheduler_config(policy=name, max_num_batched_tokens=77).max_num_batched_tokens == 77
    sched = make_scheduler(cfg, BlockManager(8, 16))
    assert type(sched) is cls
    assert spec.stat_names[0] == "preemptions"  # every policy reports its preemptions
    assert spec.read_stats(sched)["preemptions"] == sched.num_preemptions == 0
    assert spec.help and "§" in spec.help  # the paper section it follows


def test_builtin_order_and_what_each_needs():
    assert policy_names() == ("separate", "hybrid", "throttle", "td-pipe", "vllm-pp")
    assert [n for n in policy_names() if get_policy(n).needs_predictor] == ["td-pipe"]
    td = get_policy("td-pipe")
    assert td.stat_names == ("preemptions", "phase_switches")
    assert td.read_stats(make_scheduler(SchedulerConfig(policy="td-pipe"), BlockManager(8, 16))) == {
        "preemptions": 0, "phase_switches": 0}
    assert td.stats_text({"preemptions": 3, "phase_switches": 20}) == "3 preemptions; 20 phase switches"
    # step costs are profiled only for the intensity switches (Approach 3); finish-ratio does not compare them
    assert td.wants_step_costs(SchedulerConfig(policy="td-pipe"))
    assert td.wants_step_costs(scheduler_config(policy="td-pipe", switch_to_prefill="reachable-intensity"))
    assert not td.wants_step_costs(scheduler_config(policy="td-pipe", switch_to_prefill="finish-ratio:0.5"))
    for name in ("separate", "hybrid", "throttle", "vllm-pp"):
        assert not get_policy(name).wants_step_costs(SchedulerConfig(policy=name))
        assert get_policy(name).stat_names == ("preemptions",)


def test_predictor_goes_only_to_policies_that_need_one():
    marker = object()
    assert make_scheduler(SchedulerConfig(policy="td-pipe"), BlockManager(8, 16), predictor=marker).predictor \
        is marker
    # separate's constructor takes no predictor: passing it along would be a TypeError
    assert type(make_scheduler(SchedulerConfig(), BlockManager(8, 16), predictor=marker)) is SeparateScheduler


@pytest.mark.parametrize("make", [lambda: get_policy("fcfs"), lambda: scheduler_config(policy="fcfs"),
                                  lambda: scheduler_config(policy=None),
                                  lambda: EngineArgs(scheduler="fcfs").create_engine_config(),
                                  lambda: make_scheduler(SchedulerConfig(policy="fcfs"), BlockManager(8, 16))])
def test_unknown_policy_names_the_field_and_the_choices(make):
    with pytest.raises(ValueError) as e:
        make()
    msg = str(e.value)
    assert msg.startswith("scheduler must be one of")
    assert all(repr(n) in msg for n in BUILTIN)


def test_a_policy_registered_in_a_test_is_usable_everywhere(isolated_registry):
    @dataclasses.dataclass
    class ToyKnobs:
        toy_rounds: int = option(3, "toy-fifo: rounds per batch (default: %(default)s)", "--toy-rounds", type=int)

    @register_policy("toy-fifo", default_token_budget=123, needs_predictor=True, knobs=ToyKnobs,
                     stats=(PolicyStat("toy_batches", "num_batches", "batches formed"),),
                     help="a toy policy for the registry test (no paper, §0)", budget_help="whatever it likes")
    class ToyScheduler(SeparateScheduler):
        def __init__(self, config, block_manager, predictor=None, **parts):
            super().__init__(config, block_manager, **parts)
            self.predictor = predictor
            self.num_batches = 0

    assert "toy-fifo" in policy_names()
    cfg = scheduler_config(policy="toy-fifo")
    assert cfg.max_num_batched_tokens == 123 and cfg.knobs == ToyKnobs(3)
    # its knob is a flag and an LLM() keyword, declared only in ToyKnobs
    args = EngineArgs.from_kwargs(scheduler="toy-fifo", toy_rounds=5)
    assert args.create_engine_config().scheduler.knobs == ToyKnobs(5)
    assert EngineArgs.from_cli(build_parser().parse_args(["generate", "--scheduler", "toy-fifo", "--toy-rounds",
                                                          "7"])).create_engine_config().scheduler.knobs.toy_rounds == 7
    marker = object()
    sched = make_scheduler(cfg, BlockManager(8, 16), predictor=marker)
    assert type(sched) is ToyScheduler and sched.predictor is marker
    assert get_policy("toy-fifo").read_stats(sched) == {"preemptions": 0, "toy_batches": 0}

    parser = build_parser()
    for cmd in ("generate", "chat", "simulate"):
        action = next(a for a in _subparser(parser, cmd)._actions if a.dest == "scheduler")
        assert "toy-fifo" in action.choices
    assert parser.parse_args(["generate", "--scheduler", "toy-fifo"]).scheduler == "toy-fifo"
    help_text = _subparser(parser, "generate").format_help()
    assert "toy-fifo = a toy policy for the registry test" in help_text
    assert "123 for toy-fifo = whatever it likes" in help_text


def test_registration_errors(isolated_registry):
    with pytest.raises(ValueError, match="'separate' is already registered by SeparateScheduler"):
        register_policy("separate", default_token_budget=1, help="x")(type("Other", (SeparateScheduler,), {}))
    register_policy("separate", default_token_budget=8192, help="x")(SeparateScheduler)  # same class: fine
    with pytest.raises(ValueError, match="default_token_budget must be an integer >= 1"):
        register_policy("zero", default_token_budget=0, help="x")
    with pytest.raises(ValueError, match="stat names must be unique"):
        register_policy("dup", default_token_budget=1, help="x",
                        stats=(PolicyStat("preemptions", "num_preemptions", "again"),))


def test_cli_defaults_are_the_engine_args_and_knob_defaults():
    a = build_parser().parse_args(["generate"])
    for f in flagged(EngineArgs):
        assert getattr(a, f.name) == f.default, f.name
    for spec in policies():
        for f in flagged(spec.knobs) if spec.knobs else ():
            assert getattr(a, f.name) == f.default, (spec.name, f.name)
    assert a.future_points == TDPipeKnobs.future_points == (32, 1024)
    assert a.work_stealing is True and a.profile_cache is True  # --no-work-stealing / --no-profile-cache unset
    # EngineArgs' defaults are the config dataclasses' own (declared once there)
    want = dataclasses.replace(EngineConfig(), scheduler=get_policy("separate").configure(SchedulerConfig()))
    assert EngineArgs().create_engine_config() == want
    assert EngineArgs.from_cli(a).create_engine_config() == want
    # every engine flag is a field of EngineArgs, a policy's knob or one of vLLM's ignored arguments (whose
    # default is None: given or not); a new flag with a literal default fails here
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    dests = {x.dest for x in p._actions} - {"help"}
    assert dests == {f.name for f in flagged(EngineArgs)} | set(knob_owners()) | set(IGNORED)
    assert all(getattr(a, name) is None for name in IGNORED)


def test_engine_flags_keep_their_names():
    a = build_parser().parse_args(["generate", "--pp", "2", "--tp", "1", "--threads", "3", "--no-work-stealing",
                                   "--no-profile-cache", "--future-points", "8,64", "--throttle-T", "2",
                                   "--pipeline-parallel-size", "2", "--no-enable-prefix-caching"])
    kw = EngineArgs.from_cli(a).to_kwargs()
    assert kw["pipeline_parallel_size"] == 2 and kw["num_threads"] == 3 and kw["work_stealing"] is False
    assert kw["future_points"] == (8, 64) and kw["throttle_T"] == 2.0 and kw["profile_cache"] is False
    assert kw["enable_prefix_caching"] is False
    cfg = EngineArgs.from_kwargs(**kw | {"scheduler": "td-pipe"}).create_engine_config()
    assert cfg.parallel.pipeline_parallel_size == 2 and cfg.scheduler.pipeline_depth is None  # the builder: pp
    assert cfg.scheduler.knobs == TDPipeKnobs((8, 64), work_stealing=False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--future-points", "8"])


def test_pipeline_depth_defaults_to_the_stages_and_is_checked():
    a = build_parser().parse_args(["generate", "--pp", "2", "--pipeline-depth", "3"])
    assert EngineArgs.from_cli(a).create_engine_config().scheduler.pipeline_depth == 3
    assert EngineArgs.from_kwargs(pipeline_parallel_size=3).create_engine_config().scheduler.pipeline_depth is None
    with pytest.raises(ValueError, match="pipeline_depth"):
        EngineArgs.from_kwargs(pipeline_depth=0).create_engine_config()


def test_unknown_keyword_is_named():
    with pytest.raises(TypeError, match="'throttle_t'; did you mean 'throttle_T'"):
        EngineArgs.from_kwargs(throttle_t=2.0)
    with pytest.raises(TypeError, match="'bogus'"):
        EngineArgs.from_kwargs(bogus=1)
    with pytest.raises(ValueError, match="kv_thresh"):  # another policy's knob is still checked
        EngineArgs.from_kwargs(scheduler="separate", kv_thresh=2.0).create_engine_config()
    with pytest.raises(ValueError, match="predictor"):
        EngineArgs.from_kwargs(predictor="magic").create_engine_config()


def test_knob_names_are_unique_across_policies(isolated_registry):
    @dataclasses.dataclass
    class Clash:
        kv_thresh: float = option(0.1, "x", "--kv-thresh", type=float)

    with pytest.raises(ValueError, match="knob 'kv_thresh' is already declared by 'throttle'"):
        register_policy("clash", default_token_budget=1, help="x", knobs=Clash)
    assert get_policy("throttle").knobs is ThrottleKnobs


def test_cli_help_shows_the_dataclass_defaults():
    text = _subparser(build_parser(), "generate").format_help()
    assert f"most sequences in one batch (default: {SchedulerConfig.max_num_seqs})" in text
    assert f"(Eq. 3; default: {ThrottleKnobs.throttle_T})" in text
    assert "default: {},{})".format(*TDPipeKnobs.future_points) in text
    assert f"batching policy (default: {SchedulerConfig.policy})" in text
    for name, (_, budget) in BUILTIN.items():
        assert f"{budget} for {name}" in text


def test_registry_and_config_import_without_torch():
    code = ("import sys; from tdpipe.engine_args import EngineArgs; "
            "EngineArgs(scheduler='td-pipe').create_engine_config(); import tdpipe.entrypoints.args; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
