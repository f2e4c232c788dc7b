"""Batching policies. Each policy file registers itself (registry.py); importing this package loads them all,
in the order the CLI lists them."""
from tdpipe.core.scheduler.base import Scheduler
from tdpipe.core.scheduler.registry import PolicySpec, PolicyStat, get_policy, policy_names, register_policy
from tdpipe.core.scheduler.separate import SeparateScheduler
from tdpipe.core.scheduler.hybrid import HybridScheduler  # noqa: I001 (registration order = CLI order)
from tdpipe.core.scheduler.throttle import ThrottleScheduler
from tdpipe.core.scheduler.td_pipe import TDPipeScheduler
from tdpipe.core.scheduler.vllm_pp import VllmPPScheduler


def make_scheduler(config, block_manager, predictor=None, eos_token_ids=(), costs=None) -> Scheduler:
    """The scheduler for `config.policy`; `predictor` is handed only to policies that ask for one."""
    return get_policy(config.policy).build(config, block_manager, predictor, eos_token_ids, costs)


__all__ = ["HybridScheduler", "PolicySpec", "PolicyStat", "Scheduler", "SeparateScheduler", "TDPipeScheduler",
           "ThrottleScheduler", "VllmPPScheduler", "get_policy", "make_scheduler", "policy_names", "register_policy"]
