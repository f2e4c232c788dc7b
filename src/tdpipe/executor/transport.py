"""torch.distributed transport for the pipeline: rank 0 is the engine, ranks 1..pp are the stages.

Three process groups over one store, so no pair of peers ever shares a channel between two threads:
  ctrl  engine -> stages: metadata messages (pickled, header + payload)
  reply stages -> engine: start-up acknowledgements and traces
  data  stage k -> stage k+1 hidden states, last stage -> engine results; the receiver knows the shape
        from the metadata it already holds, so a tensor travels alone with no size handshake
        (gLLM §3.3, SiPipe §5.3). gloo, CPU tensors (CUDA stages with NCCL are not built yet).
Groups are built directly (not the global default group), so several engines can live in one process.
"""
from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

CTRL_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class Rendezvous:
    rank: int
    world_size: int
    store: dist.Store


def serve_rendezvous(world_size: int, host: str = "127.0.0.1") -> tuple[Rendezvous, int]:
    """Engine side, single machine: a TCPStore on a free port; returns it and the port for the workers."""
    store = dist.TCPStore(host, 0, world_size, True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    return Rendezvous(0, world_size, store), store.port


def join_rendezvous(host: str, port: int, rank: int, world_size: int) -> Rendezvous:
    store = dist.TCPStore(host, port, world_size, False, timeout=datetime.timedelta(seconds=120))
    return Rendezvous(rank, world_size, store)


def torchrun_env() -> bool:
    """Launched by torchrun (or any launcher that sets the env:// variables)?"""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def torchrun_rendezvous() -> Rendezvous:
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=300)))
    return Rendezvous(rank, world, store)


class Transport:
    def __init__(self, rv: Rendezvous) -> None:
        self.rank, self.world_size = rv.rank, rv.world_size
        store = dist.PrefixStore("tdpipe", rv.store)
        self._store = rv.store  # keep the TCPStore (and its server on rank 0) alive
        self.ctrl = self._gloo(dist.PrefixStore("ctrl", store))
        self.reply = self._gloo(dist.PrefixStore("reply", store))
        self.data = self._gloo(dist.PrefixStore("data", store))

    def _gloo(self, store: dist.Store) -> dist.ProcessGroupGloo:
        return dist.ProcessGroupGloo(store, self.rank, self.world_size, CTRL_TIMEOUT)

    # -- objects (metadata) -----------------------------------------------------------------------------
    # One message per object: [kind, nbytes] then the pickle, received into a fixed-size buffer (gloo
    # accepts a message shorter than the posted buffer). Objects larger than the buffer follow in a second
    # message whose size the first one announces.
    SLAB = 1 << 18

    @classmethod
    def pack(cls, kind: int, obj: object) -> list[torch.Tensor]:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.tensor([kind, len(data)], dtype=torch.int64).view(torch.uint8)
        if len(data) + 16 <= cls.SLAB:
            return [torch.cat([head, torch.frombuffer(bytearray(data), dtype=torch.uint8)])]
        return [head, torch.frombuffer(bytearray(data), dtype=torch.uint8)]

    def isend_packed(self, group: dist.ProcessGroup, packed: list[torch.Tensor], dst: int) -> list:
        return [group.send([t], dst, i) for i, t in enumerate(packed)]

    def recv_obj(self, group: dist.ProcessGroup, src: int) -> tuple[int, object]:
        slab = torch.empty(self.SLAB, dtype=torch.uint8)
        group.recv([slab], src, 0).wait()
        kind, n = slab[:16].view(torch.int64).tolist()
        if n + 16 <= self.SLAB:
            return kind, pickle.loads(slab[16:16 + n].numpy().tobytes())
        payload = torch.empty(n, dtype=torch.uint8)
        group.recv([payload], src, 1).wait()
        return kind, pickle.loads(payload.numpy().tobytes())

    def send_obj(self, group: dist.ProcessGroup, kind: int, obj: object, dst: int) -> None:
        for w in self.isend_packed(group, self.pack(kind, obj), dst):
            w.wait()

    # -- tensors (activations, results) -------------------------------------------------------------------
    def isend(self, t: torch.Tensor, dst: int, tag: int):
        return self.data.send([t], dst, tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int):
        return self.data.recv([t], src, tag)


def tensor_tag(batch_id: int) -> int:
    """One tag per micro-batch for activations and results, so nothing relies on posting order."""
    return 16 + batch_id % (1 << 30)
