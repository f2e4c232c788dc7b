"""The batching policies, by name: each policy file registers itself here, so nothing else lists them.

A `PolicySpec` says what the rest of tdpipe needs to know about a policy without naming it:
  - its default token budget (SchedulerConfig.max_num_batched_tokens when the user gives none),
  - whether it asks a `Predictor` for output lengths (the engine then builds and batches one for it),
  - whether it uses step costs measured at start-up (the engine then profiles the executor and sets the
    scheduler's `costs` attribute, a `StepCostModel`),
  - the counters it reports (scheduler attributes that the bench, the simulator and /metrics read),
  - a paragraph of help for the CLI, with the paper section it follows.
`make_scheduler`, SchedulerConfig's validation, the CLI's --scheduler choices, the bench and the simulator
all read the registry; a new policy is one file with a `@register_policy(...)` on its class.

Pure Python (no torch), like the rest of core/scheduler: config.py reads it while validating.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


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
    # uses a StepCostModel measured at start-up (set as scheduler.costs); a callable decides from the config
    # (td-pipe needs them only for its intensity switches). Read it through `wants_step_costs(config)`.
    needs_step_costs: bool | Callable[[Any], bool] = False
    stats: tuple[PolicyStat, ...] = (PREEMPTIONS,)  # always starts with PREEMPTIONS (register_policy adds it)

    def build(self, config: Any, block_manager: Any, predictor: Any = None) -> Any:
        """The scheduler; the predictor goes only to a policy that asks for one."""
        if self.needs_predictor:
            return self.cls(config, block_manager, predictor=predictor)
        return self.cls(config, block_manager)

    def wants_step_costs(self, config: Any) -> bool:
        """Whether the engine should measure step costs for this policy under this SchedulerConfig."""
        n = self.needs_step_costs
        return bool(n(config) if callable(n) else n)

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
                    stats: tuple[PolicyStat, ...] = ()) -> Callable[[type], type]:
    """Class decorator: register the scheduler class under `name`. `stats` are the policy's own counters;
    preemptions are added for every policy. A name registered twice is an error (two policies, one flag)."""
    _check_spec(name, default_token_budget, stats)

    def deco(cls: type) -> type:
        old = _POLICIES.get(name)
        if old is not None and old.cls is not cls:
            raise ValueError(f"scheduler policy {name!r} is already registered by {old.cls.__qualname__}")
        _POLICIES[name] = PolicySpec(name, cls, default_token_budget, help, budget_help, needs_predictor,
                                     needs_step_costs, (PREEMPTIONS, *stats))
        return cls

    return deco


def _check_spec(name: str, budget: int, stats: tuple[PolicyStat, ...]) -> None:
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"a policy name must be a non-empty string without surrounding spaces, got {name!r}")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"policy {name!r}: default_token_budget must be an integer >= 1, got {budget!r}")
    names = [s.name for s in (PREEMPTIONS, *stats)]
    if len(set(names)) != len(names):
        raise ValueError(f"policy {name!r}: stat names must be unique, got {names}")


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


__all__ = ["PREEMPTIONS", "PolicySpec", "PolicyStat", "get_policy", "policies", "policy_names", "register_policy"]
