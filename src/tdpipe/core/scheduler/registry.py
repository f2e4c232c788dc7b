"""The batching policies, by name: each policy file registers itself here, so nothing else lists them.

A `PolicySpec` says what the rest of tdpipe needs to know about a policy without naming it:
  - its default token budget (SchedulerConfig.max_num_batched_tokens when the user gives none),
  - its knobs: a dataclass whose fields declare their defaults, help and flags (tdpipe/options.py); the
    command line, `LLM(...)`'s keywords and the simulator derive theirs from it, and the scheduler reads
    them from `config.knobs` (filled in by `configure`),
  - whether it asks a `Predictor` for output lengths (the engine then builds and batches one for it),
  - whether it uses step costs measured at start-up (the engine builder then profiles the executor and
    hands the scheduler a `StepCostModel` as `costs=`),
  - the counters it reports (scheduler attributes that the bench, the simulator and /metrics read),
  - a paragraph of help for the CLI, with the paper section it follows.
`make_scheduler`, SchedulerConfig's validation, the CLI's --scheduler choices, the bench and the simulator
all read the registry; a new policy, knobs included, is one file with a `@register_policy(...)` on its class.

Pure Python (no torch), like the rest of core/scheduler.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from tdpipe.config import SchedulerConfig


@dataclass(frozen=True)
class PolicyStat:
    """A counter a policy keeps: `attr` on the scheduler holds its running total since start-up."""

    name: str  # the key in bench / simulator JSON and the metric's name (e.g. "phase_switches")
    attr: str  # the scheduler's attribute or property (e.g. "num_switches")
    help: str  # one line for tables and metric descriptions


# every policy preempts (recompute) when the KV cache runs out: Scheduler.num_preemptions
PREEMPTIONS = PolicyStat("preemptions", "num_preemptions",
                         "running requests preempted (KV freed, recomputed later) because the KV cache ran out")


@dataclass(frozen=True)
class PolicySpec:
    name: str  # the --scheduler / SchedulerConfig.policy value
    cls: type  # a Scheduler subclass: cls(config, block_manager[, predictor=...])
    default_token_budget: int  # max_num_batched_tokens when none is given
    help: str  # one paragraph: what the policy does and the paper section it follows
    budget_help: str = ""  # what the token budget means for this policy (CLI help of --max-num-batched-tokens)
    needs_predictor: bool = False  # cls takes predictor=...: output lengths ahead of time
    # uses a StepCostModel measured at start-up (cls takes costs=...); a callable decides from the config
    # (td-pipe needs them only for its intensity switches). Read it through `wants_step_costs(config)`.
    needs_step_costs: bool | Callable[[Any], bool] = False
    stats: tuple[PolicyStat, ...] = (PREEMPTIONS,)  # always starts with PREEMPTIONS (register_policy adds it)
    knobs: type | None = None  # the policy's own settings: a dataclass of `tdpipe.options.option` fields

    @property
    def knob_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.knobs)) if self.knobs else ()

    def make_knobs(self, values: Any = None) -> Any:
        """The policy's knob object from None (its defaults), a dict of knob values, or the object itself; a
        name that is not one of its knobs is a TypeError naming it. None for a policy without knobs."""
        if self.knobs is None:
            if values:
                raise TypeError(f"scheduler {self.name!r} has no knobs, got {values!r}")
            return None
        if isinstance(values, self.knobs):
            return values
        if values is not None and not isinstance(values, dict):
            raise TypeError(f"knobs of scheduler {self.name!r} must be a {self.knobs.__name__} or a dict, "
                            f"got {type(values).__name__}")
        unknown = sorted(set(values or ()) - set(self.knob_names))
        if unknown:
            raise TypeError(f"scheduler {self.name!r} has no knob {unknown[0]!r}; its knobs: {list(self.knob_names)}")
        return self.knobs(**(values or {}))

    def configure(self, config: SchedulerConfig) -> SchedulerConfig:
        """Fill in what the policy decides for a SchedulerConfig: its token budget when none was given, and its
        knob object. Idempotent; returns the same config (the engine and the scheduler share it)."""
        if config.max_num_batched_tokens is None:
            config.max_num_batched_tokens = self.default_token_budget
        config.knobs = self.make_knobs(config.knobs)
        return config

    def build(self, config: Any, block_manager: Any, predictor: Any = None, eos_token_ids: Any = (),
              costs: Any = None) -> Any:
        """The scheduler, given all it needs at construction: its configured config (`configure`); the model's
        eos ids; the predictor only to a policy that asks for one; measured step costs only when some were
        measured (`wants_step_costs`)."""
        self.configure(config)
        kw: dict[str, Any] = {"eos_token_ids": eos_token_ids}
        if self.needs_predictor:
            kw["predictor"] = predictor
        if costs is not None:
            kw["costs"] = costs
        return self.cls(config, block_manager, **kw)

    def wants_step_costs(self, config: Any) -> bool:
        """Whether the engine should measure step costs for this policy under this SchedulerConfig."""
        n = self.needs_step_costs
        return bool(n(self.configure(config)) if callable(n) else n)

    @property
    def stat_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stats)

    def read_stats(self, scheduler: Any) -> dict[str, Any]:
        """The policy's counters now, by stat name (a bench takes the difference of two readings)."""
        return {s.name: getattr(scheduler, s.attr) for s in self.stats}

    def stats_text(self, values: dict[str, Any]) -> str:
        """'3 preemptions; 20 phase switches': the policy's counters in a result (keyed by stat name)."""
        return "; ".join(f"{values[s.name]} {s.name.replace('_', ' ')}" for s in self.stats)


_POLICIES: dict[str, PolicySpec] = {}


def register_policy(name: str, *, default_token_budget: int, help: str, budget_help: str = "",
                    needs_predictor: bool = False, needs_step_costs: bool | Callable[[Any], bool] = False,
                    stats: tuple[PolicyStat, ...] = (), knobs: type | None = None) -> Callable[[type], type]:
    """Class decorator: register the scheduler class under `name`. `stats` are the policy's own counters;
    preemptions are added for every policy. `knobs`: the dataclass of its own settings (flags and keywords
    are derived from it). A name registered twice is an error (two policies, one flag), and so is a knob
    another policy already declares (one flag, two meanings)."""
    _check_spec(name, default_token_budget, stats, knobs)

    def deco(cls: type) -> type:
        old = _POLICIES.get(name)
        if old is not None and old.cls is not cls:
            raise ValueError(f"scheduler policy {name!r} is already registered by {old.cls.__qualname__}")
        _POLICIES[name] = PolicySpec(name, cls, default_token_budget, help, budget_help, needs_predictor,
                                     needs_step_costs, (PREEMPTIONS, *stats), knobs)
        return cls

    return deco


def _check_spec(name: str, budget: int, stats: tuple[PolicyStat, ...], knobs: type | None) -> None:
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"a policy name must be a non-empty string without surrounding spaces, got {name!r}")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"policy {name!r}: default_token_budget must be an integer >= 1, got {budget!r}")
    names = [s.name for s in (PREEMPTIONS, *stats)]
    if len(set(names)) != len(names):
        raise ValueError(f"policy {name!r}: stat names must be unique, got {names}")
    if knobs is None:
        return
    if not dataclasses.is_dataclass(knobs):
        raise ValueError(f"policy {name!r}: knobs must be a dataclass, got {knobs!r}")
    for other in _POLICIES.values():
        shared = set(other.knob_names) & {f.name for f in dataclasses.fields(knobs)}
        if other.name != name and other.knobs is not knobs and shared:
            raise ValueError(f"policy {name!r}: knob {sorted(shared)[0]!r} is already declared by {other.name!r}")


def _load_builtin() -> None:
    """Importing the package imports every built-in policy file, which registers it."""
    import tdpipe.core.scheduler  # noqa: F401


def get_policy(name: str) -> PolicySpec:
    """The spec registered under `name`; a ValueError naming the `scheduler` field and the choices otherwise."""
    _load_builtin()
    spec = _POLICIES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"scheduler must be one of {policy_names()}, got {name!r}")
    return spec


def policy_names() -> tuple[str, ...]:
    """Registered policy names, in registration order (the built-ins: separate, hybrid, throttle, td-pipe)."""
    _load_builtin()
    return tuple(_POLICIES)


def policies() -> tuple[PolicySpec, ...]:
    _load_builtin()
    return tuple(_POLICIES.values())


def knob_owners() -> dict[str, PolicySpec]:
    """Every registered knob name -> the policy that declares it (keywords are filtered through these)."""
    return {k: s for s in policies() for k in s.knob_names}


def scheduler_config(**kw: Any) -> SchedulerConfig:
    """A configured SchedulerConfig from flat keywords: its own fields and its policy's knobs by name (the
    keywords are filtered through the two dataclasses' fields); any other keyword is a TypeError naming it."""
    spec = get_policy(kw.get("policy", SchedulerConfig.policy))
    own = {f.name for f in dataclasses.fields(SchedulerConfig)} - {"knobs"}
    knobs = {k: kw.pop(k) for k in list(kw) if k not in own}
    return spec.configure(SchedulerConfig(**kw, knobs=spec.make_knobs(knobs)))


__all__ = ["PREEMPTIONS", "PolicySpec", "PolicyStat", "get_policy", "knob_owners", "policies", "policy_names",
           "register_policy", "scheduler_config"]
