from tdpipe.core.scheduler.base import Scheduler
from tdpipe.core.scheduler.hybrid import HybridScheduler
from tdpipe.core.scheduler.separate import SeparateScheduler
from tdpipe.core.scheduler.td_pipe import TDPipeScheduler
from tdpipe.core.scheduler.throttle import ThrottleScheduler

POLICIES: dict[str, type[Scheduler]] = {"separate": SeparateScheduler, "hybrid": HybridScheduler,
                                        "throttle": ThrottleScheduler, "td-pipe": TDPipeScheduler}


def make_scheduler(config, block_manager, predictor=None) -> Scheduler:
    if config.policy == "td-pipe":
        return TDPipeScheduler(config, block_manager, predictor=predictor)
    return POLICIES[config.policy](config, block_manager)


__all__ = ["POLICIES", "HybridScheduler", "Scheduler", "SeparateScheduler", "TDPipeScheduler", "ThrottleScheduler", "make_scheduler"]
