from tdpipe.core.scheduler.base import Scheduler
from tdpipe.core.scheduler.hybrid import HybridScheduler
from tdpipe.core.scheduler.separate import SeparateScheduler

POLICIES: dict[str, type[Scheduler]] = {"separate": SeparateScheduler, "hybrid": HybridScheduler}


def make_scheduler(config, block_manager) -> Scheduler:
    return POLICIES[config.policy](config, block_manager)


__all__ = ["POLICIES", "HybridScheduler", "Scheduler", "SeparateScheduler", "make_scheduler"]
