"""Which torch.distributed backend each of the pipeline's groups uses, and the one function that builds a group.

Groups (pipeline/wire/transport.py): ctrl, reply and data connect the engine (rank 0, host memory) with every
worker and stay on gloo on every device: control messages are small pickles, results go to the engine's host
memory. Two kinds of group carry device tensors and follow the device:
  stages  worker -> worker activations (stage s -> s + 1) and the split lm_head's rows (last -> first)
  tp<s>   stage s's T ranks: the tensor-parallel all-reduces and gathers (model/tensor_parallel.py)
On CPU both are gloo (stage traffic then rides the data group, as it always has). On CUDA each is NCCL
where its members are on distinct GPUs; NCCL refuses two ranks of one communicator on one GPU, so a group
whose members share a GPU (pp = 2 on one H100) falls back to gloo with host staging: device -> host copy,
gloo send, host -> device copy on the receiving side (pipeline/wire/staging.py).

NOT YET RUN ON A GPU: the NCCL groups have never been built; the selection below and the host staging are
tested on CPU (gloo) only.
"""
from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tdpipe.pipeline.wire.layout import Layout

GLOO, NCCL = "gloo", "nccl"


@dataclass(frozen=True)
class GroupBackends:
    """The backend of each device-tensor group of a layout."""

    stages: str  # worker -> worker activations; GLOO means the data group with host staging where needed
    tp: tuple[str, ...]  # per stage: its tensor-parallel group (GLOO for a stage of one rank: no group)


def _distinct(devices: Sequence[torch.device]) -> bool:
    return len(set(devices)) == len(devices)


def choose_backends(dist_backend: str, devices: Sequence[torch.device | str], layout: Layout) -> GroupBackends:
    """The backends from the platform's preferred one (Platform.dist_backend) and each worker's device
    (devices[i]: worker rank i + 1, tdpipe/pipeline/wire/layout.py). A pure function, so the choice is tested
    without the devices: NCCL for a group only when the platform prefers it, the group has traffic (pp > 1
    for stages, T > 1 for tp) and every member has a GPU of its own."""
    devs = [torch.device(d) for d in devices]
    if len(devs) != layout.num_workers:
        raise ValueError(f"{len(devs)} devices for the {layout.num_workers} workers of a {layout}")
    if dist_backend not in (GLOO, NCCL):
        raise ValueError(f"unknown distributed backend {dist_backend!r}")
    nccl = dist_backend == NCCL
    stages = NCCL if nccl and layout.pp > 1 and _distinct(devs) else GLOO
    tp = []
    for s in range(layout.pp):
        members = [devs[r - 1] for r in layout.stage_ranks(s)]
        tp.append(NCCL if nccl and layout.tp > 1 and _distinct(members) else GLOO)
    return GroupBackends(stages, tuple(tp))


def gloo_options(loopback: bool, timeout: datetime.timedelta) -> dist.ProcessGroupGloo._Options | datetime.timedelta:
    """gloo's options: a loopback device when every rank is on this machine (gloo otherwise binds the
    address the hostname resolves to), else torch's default device with this timeout."""
    if not loopback:
        return timeout  # torch's default device: GLOO_SOCKET_IFNAME, else the hostname's address
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return opts


def new_group(backend: str, store: dist.Store, rank: int, size: int, gloo_opts: object,
              timeout: datetime.timedelta) -> dist.ProcessGroup:
    """Every process group of the pipeline is built here (directly, not as torch's default group, so several
    engines can live in one process). `gloo_opts`: gloo_options(...); `timeout` bounds NCCL's."""
    if backend == GLOO:
        return dist.ProcessGroupGloo(store, rank, size, gloo_opts)
    if backend == NCCL:
        if not dist.is_nccl_available():
            raise RuntimeError("the NCCL backend is not available in this torch build")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"unknown distributed backend {backend!r}")


__all__ = ["GLOO", "NCCL", "GroupBackends", "choose_backends", "gloo_options", "new_group"]
