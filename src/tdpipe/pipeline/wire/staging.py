"""Host staging: device tensors over gloo, which moves host memory only. A send copies the tensor to the
host first; a receive lands in a host buffer and is copied into the device tensor when waited on. Used when
two workers share a GPU (NCCL refuses that: pipeline/wire/groups.py) and for results the last stage sends
the engine. Never on CPU, where tensors are host memory already. Tested on CPU tensors standing in for
device ones; NOT YET RUN ON A GPU.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class StagedSend:
    """A send of a host copy; holds the copy until the send is done."""

    def __init__(self, work, host: torch.Tensor) -> None:
        self.work, self.host = work, host

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return self.work.wait(timeout) if timeout is not None else self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


class StagedRecv:
    """A receive into a host buffer; wait() copies it into the destination tensor (once)."""

    def __init__(self, work, host: torch.Tensor, dst: torch.Tensor) -> None:
        self.work, self.host, self.dst = work, host, dst
        self._copied = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        done = self.work.wait(timeout) if timeout is not None else self.work.wait()
        if not self._copied:
            self.dst.copy_(self.host)
            self._copied = True
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()


def staged_send(group: dist.ProcessGroup, t: torch.Tensor, dst: int, tag: int) -> StagedSend:
    host = t.detach().to("cpu").contiguous()  # a synchronous copy: the data is final before gloo reads it
    return StagedSend(group.send([host], dst, tag), host)


def staged_recv(group: dist.ProcessGroup, t: torch.Tensor, src: int, tag: int) -> StagedRecv:
    host = torch.empty(t.shape, dtype=t.dtype)
    return StagedRecv(group.recv([host], src, tag), host, t)


__all__ = ["StagedRecv", "StagedSend", "staged_recv", "staged_send"]
