"""The policy registry: every policy registers itself, and make_scheduler, SchedulerConfig and the CLI read it;
the CLI's defaults are the config dataclasses' own. Unit tests, no model."""
import argparse
import subprocess
import sys

import pytest

from tdpipe.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler import (HybridScheduler, SeparateScheduler, TDPipeScheduler, ThrottleScheduler,
                                   make_scheduler, registry)
from tdpipe.core.scheduler.registry import PolicyStat, get_policy, policy_names, register_policy
from tdpipe.entrypoints import args as cli_args
from tdpipe.entrypoints.cli import build_parser

BUILTIN = {"separate": (SeparateScheduler, 8192), "hybrid": (HybridScheduler, 512),
           "throttle": (ThrottleScheduler, 2048 + 256), "td-pipe": (TDPipeScheduler, 2048)}


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
    cfg = SchedulerConfig(policy=name)
    assert cfg.max_num_batched_tokens == budget
    assert SchedulerConfig(policy=name, max_num_batched_tokens=77).max_num_batched_tokens == 77
    sched = make_scheduler(cfg, BlockManager(8, 16))
    assert type(sched) is cls
    assert spec.stat_names[0] == "preemptions"  # every policy reports its preemptions
    assert spec.read_stats(sched)["preemptions"] == sched.num_preemptions == 0
    assert spec.help and "§" in spec.help  # the paper section it follows


def test_builtin_order_and_what_each_needs():
    assert policy_names() == ("separate", "hybrid", "throttle", "td-pipe")
    assert [n for n in policy_names() if get_policy(n).needs_predictor] == ["td-pipe"]
    td = get_policy("td-pipe")
    assert td.stat_names == ("preemptions", "phase_switches")
    assert td.read_stats(make_scheduler(SchedulerConfig(policy="td-pipe"), BlockManager(8, 16))) == {
        "preemptions": 0, "phase_switches": 0}
    assert td.stats_text({"preemptions": 3, "phase_switches": 20}) == "3 preemptions; 20 phase switches"
    # step costs are profiled only for the intensity switches (Approach 3); finish-ratio does not compare them
    assert td.wants_step_costs(SchedulerConfig(policy="td-pipe"))
    assert td.wants_step_costs(SchedulerConfig(policy="td-pipe", switch_to_prefill="reachable-intensity"))
    assert not td.wants_step_costs(SchedulerConfig(policy="td-pipe", switch_to_prefill="finish-ratio:0.5"))
    for name in ("separate", "hybrid", "throttle"):
        assert not get_policy(name).wants_step_costs(SchedulerConfig(policy=name))
        assert get_policy(name).stat_names == ("preemptions",)


def test_predictor_goes_only_to_policies_that_need_one():
    marker = object()
    assert make_scheduler(SchedulerConfig(policy="td-pipe"), BlockManager(8, 16), predictor=marker).predictor \
        is marker
    # separate's constructor takes no predictor: passing it along would be a TypeError
    assert type(make_scheduler(SchedulerConfig(), BlockManager(8, 16), predictor=marker)) is SeparateScheduler


@pytest.mark.parametrize("make", [lambda: get_policy("fcfs"), lambda: SchedulerConfig(policy="fcfs"),
                                  lambda: SchedulerConfig(policy=None)])
def test_unknown_policy_names_the_field_and_the_choices(make):
    with pytest.raises(ValueError) as e:
        make()
    msg = str(e.value)
    assert msg.startswith("scheduler must be one of")
    assert all(repr(n) in msg for n in BUILTIN)


def test_a_policy_registered_in_a_test_is_usable_everywhere(isolated_registry):
    @register_policy("toy-fifo", default_token_budget=123, needs_predictor=True,
                     stats=(PolicyStat("toy_batches", "num_batches", "batches formed"),),
                     help="a toy policy for the registry test (no paper, §0)", budget_help="whatever it likes")
    class ToyScheduler(SeparateScheduler):
        def __init__(self, config, block_manager, predictor=None):
            super().__init__(config, block_manager)
            self.predictor = predictor
            self.num_batches = 0

    assert "toy-fifo" in policy_names()
    cfg = SchedulerConfig(policy="toy-fifo")
    assert cfg.max_num_batched_tokens == 123
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


def test_cli_defaults_are_the_config_dataclass_defaults():
    defaults = {EngineConfig: EngineConfig(), CacheConfig: CacheConfig(), ParallelConfig: ParallelConfig(),
                SchedulerConfig: SchedulerConfig.__new__(SchedulerConfig)}  # class defaults, no __post_init__
    a = build_parser().parse_args(["generate"])
    for dest, (cls, field) in cli_args.FLAG_FIELDS.items():
        want = getattr(defaults[cls], field) if cls is not SchedulerConfig else cli_args.field_default(cls, field)
        assert getattr(a, dest) == want, (dest, cls.__name__, field)
    # the flags derived from two fields or an inverted bool
    assert a.future_points == f"{SchedulerConfig.future_point_step},{SchedulerConfig.future_point_max}"
    assert (not a.no_work_stealing) is SchedulerConfig.work_stealing
    assert (not a.no_profile_cache) is SchedulerConfig.profile_cache
    # every engine flag is one of those (a new flag with a literal default fails here)
    p = argparse.ArgumentParser()
    cli_args.add_engine_args(p)
    dests = {x.dest for x in p._actions} - {"help"}
    assert dests == set(cli_args.FLAG_FIELDS) | {"future_points", "no_work_stealing", "no_profile_cache"}


def test_cli_help_shows_the_dataclass_defaults():
    text = _subparser(build_parser(), "generate").format_help()
    assert f"most sequences in one batch (default: {SchedulerConfig.max_num_seqs})" in text
    assert f"(Eq. 3; default: {SchedulerConfig.throttle_T})" in text
    assert f"default: {SchedulerConfig.future_point_step},{SchedulerConfig.future_point_max})" in text
    assert f"batching policy (default: {SchedulerConfig.policy})" in text
    for name, (_, budget) in BUILTIN.items():
        assert f"{budget} for {name}" in text


def test_registry_and_config_import_without_torch():
    code = ("import sys; from tdpipe.config import SchedulerConfig; SchedulerConfig(policy='td-pipe'); "
            "import tdpipe.entrypoints.args; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
