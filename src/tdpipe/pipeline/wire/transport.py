"""torch.distributed transport for the pipeline: rank 0 is the engine, the P x T workers follow
(tdpipe/pipeline/wire/layout.py numbers them).

Three process groups over one store, so no pair of peers ever shares a channel between two threads:
  ctrl  engine -> stages: metadata messages (pickled, header + payload)
  reply stages -> engine: start-up acknowledgements and traces
  data  stage k -> stage k+1 hidden states, last stage -> engine results; the receiver knows the shape
        from the metadata it already holds, so a tensor travels alone with no size handshake
        (gLLM §3.3, SiPipe §5.3). gloo: device tensors are staged through host memory (wire/staging.py)
and, once the workers know the layout (use_backends, after INIT):
  stages  worker -> worker activations on NCCL, where the platform asks for it and every worker has a GPU of
        its own (wire/groups.py chooses); otherwise the data group carries them as above
  tp<s> the stage's T ranks: the Megatron all-reduces and the small greedy all-gather, used by the compute
        thread alone (tdpipe/model/tensor_parallel.py wraps it); gloo, or NCCL like `stages`
Groups are built by wire/groups.py's new_group, directly (not the global default group), so several engines
can live in one process. The NCCL groups have not yet run on a GPU.

Nothing listens beyond the loopback when the engine spawns its stages: the rendezvous store is bound to
127.0.0.1 (torch's TCPStore server otherwise binds every interface) and the gloo groups use a loopback
device (gloo otherwise binds the address the machine's hostname resolves to). Under torchrun the store is
torchrun's own (see torchrun_rendezvous) and gloo uses the loopback only when MASTER_ADDR is a loopback
address and GLOO_SOCKET_IFNAME is unset.

Timeouts: a gloo group's timeout bounds its construction only (START_TIMEOUT); every wait on a message
passes FOREVER, because a stage waits for the engine's next step for as long as the engine is idle. The
group rendezvous goes through _PollingStore, whose waits run in short slices in Python and ask an abort
callback between them, so a process never sits in C++ for minutes on a peer that died.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tdpipe.pipeline.wire.groups import GLOO, GroupBackends, gloo_options, new_group
from tdpipe.pipeline.wire.layout import ENGINE
from tdpipe.pipeline.wire.staging import staged_recv, staged_send

START_TIMEOUT = datetime.timedelta(minutes=10)  # building the groups (torchrun ranks may start far apart)
FOREVER = datetime.timedelta(days=365)  # any wait on a message: idle is not an error
STORE_TIMEOUT = datetime.timedelta(seconds=120)
_POLL = (0.001, 0.05)  # seconds between store checks while building the groups: first, most


@dataclass
class Rendezvous:
    rank: int
    world_size: int
    store: dist.Store
    loopback: bool = False  # every rank is on this machine: gloo listens on 127.0.0.1 only


def _listen(host: str, port: int) -> int:
    """A listening TCP socket bound to `host` only, for TCPStore(master_listen_fd=...)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(128)
        return s.detach()
    except BaseException:
        s.close()
        raise


def serve_rendezvous(world_size: int, host: str = "127.0.0.1") -> tuple[Rendezvous, int]:
    """Engine side, single machine: a TCPStore on a free port of `host` only (TCPStore's own server binds
    every interface); returns it and the port for the workers. The fd is adopted by the store."""
    fd = _listen(host, 0)
    port = _port_of(fd)
    store = dist.TCPStore(host, port, world_size, True, timeout=STORE_TIMEOUT, wait_for_workers=False,
                          master_listen_fd=fd)
    return Rendezvous(0, world_size, store, loopback=_is_loopback(host)), port


def _port_of(fd: int) -> int:
    s = socket.socket(fileno=os.dup(fd))
    try:
        return s.getsockname()[1]
    finally:
        s.close()


def join_rendezvous(host: str, port: int, rank: int, world_size: int) -> Rendezvous:
    store = dist.TCPStore(host, port, world_size, False, timeout=STORE_TIMEOUT)
    return Rendezvous(rank, world_size, store, loopback=_is_loopback(host))


def torchrun_env() -> bool:
    """Launched by torchrun (or any launcher that sets the env:// variables)?"""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def torchrun_rendezvous() -> Rendezvous:
    """The store of a multi-process launch. Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) it is the
    store torchrun's agent on node 0 already serves at MASTER_ADDR:MASTER_PORT; that server binds every
    interface and is not ours to change, so every rank connects to it as a client (dist.rendezvous).
    Without torchrun's agent (the env:// variables set by hand) rank 0 serves the store itself, bound to
    MASTER_ADDR's address only instead of every interface."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    loopback = _is_loopback(host) and not os.environ.get("GLOO_SOCKET_IFNAME")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=300)))
        return Rendezvous(rank, world, store, loopback)
    timeout = datetime.timedelta(seconds=300)
    if rank == 0:
        addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
        store = dist.TCPStore(host, port, world, True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=_listen(addr, port), multi_tenant=True)
    else:
        store = dist.TCPStore(host, port, world, False, timeout=timeout)
    return Rendezvous(rank, world, store, loopback)


def _is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


# -- failure reports ---------------------------------------------------------------------------------------
# A stage that fails writes one line into the store before it exits, so the engine can say why (not only
# "exited with code 1"), and the stage need not print a traceback next to the engine's error.

def _failure_key(rank: int) -> str:
    return f"tdpipe/failed/{rank}"


def report_failure(store: dist.Store, rank: int, reason: str) -> bool:
    """Stage side, best effort. The check() round trip makes sure the server holds the key before the
    stage exits (a set is not acknowledged, and the engine reads on another connection)."""
    try:
        store.set(_failure_key(rank), reason.encode())
        store.check([_failure_key(rank)])
        return True
    except Exception:  # noqa: BLE001 - the engine (and its store) may be gone already
        return False


def failure_reason(store: dist.Store, rank: int) -> str | None:
    """Engine side: what stage rank `rank` reported before it failed, if anything."""
    try:
        if store.check([_failure_key(rank)]):
            return store.get(_failure_key(rank)).decode(errors="replace")
    except Exception:  # noqa: BLE001
        pass
    return None


class _PollingStore(dist.Store):
    """The store the gloo groups rendezvous through. A TCPStore wait blocks in C++ until its timeout and
    ignores Ctrl-C; these waits poll check() in short slices and call `abort` between them, which raises to
    give up (the engine's watchdog found a dead stage, or Ctrl-C: Python signal handlers run here)."""

    def __init__(self, inner: dist.Store, abort: Callable[[], None] | None,
                 timeout: datetime.timedelta) -> None:
        super().__init__()
        self.inner = inner
        self.abort = abort
        self.limit = timeout.total_seconds()

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout else self.limit
        deadline = time.monotonic() + limit
        pause = _POLL[0]
        while not self.inner.check(keys):
            if self.abort is not None:
                self.abort()
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {limit:.0f} s waiting for the pipeline's other "
                                   f"processes to connect (store keys {keys})")
            time.sleep(pause)
            pause = min(_POLL[1], pause * 2)  # a peer still starting (torchrun) is not polled 1000 times/s


class PeerLost(RuntimeError):
    """A gloo send or receive failed: the process at the other end died or the connection broke. Never the
    root cause of a failure, so a stage that sees it lets the engine name the process that went first."""


def _gloo(fn):
    """Turn gloo's RuntimeErrors into PeerLost (posting a send or receive on a closed pair raises too)."""
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PeerLost:
            raise
        except RuntimeError as e:
            raise PeerLost(str(e)) from e
    call.__name__, call.__doc__ = fn.__name__, fn.__doc__
    return call


class Transport:
    def __init__(self, rv: Rendezvous, abort: Callable[[], None] | None = None) -> None:
        """Build the three groups. `abort` is called while waiting for the peers and may raise to give up."""
        self.rank, self.world_size = rv.rank, rv.world_size
        self._store = rv.store  # keep the TCPStore (and its server on rank 0) alive
        store = _PollingStore(dist.PrefixStore("tdpipe", rv.store), abort, START_TIMEOUT)
        self._polling = store  # referenced from C++ only through the PrefixStores: keep the Python object
        self._opts = gloo_options(rv.loopback, START_TIMEOUT)
        self.ctrl = self._group("ctrl", GLOO, self.rank, self.world_size)
        self.reply = self._group("reply", GLOO, self.rank, self.world_size)
        self.data = self._group("data", GLOO, self.rank, self.world_size)
        # a worker's device groups (use_backends); the engine keeps these defaults
        self.stages: dist.ProcessGroup | None = None  # NCCL among the workers (rank r is r - 1 there)
        self._tp_backends: tuple[str, ...] = ()
        self._staged = False  # this worker's tensors are device memory: gloo sends go through the host

    def _group(self, name: str, backend: str, rank: int, size: int) -> dist.ProcessGroup:
        return new_group(backend, dist.PrefixStore(name, self._polling), rank, size, self._opts, START_TIMEOUT)

    def use_backends(self, backends: GroupBackends, host_memory: bool, num_workers: int) -> None:
        """Worker side, after INIT: build the stages group where it is NCCL (every worker at once) and note
        the tp groups' backends and whether tensors need host staging over gloo (`host_memory`: the
        platform's tensors live in host memory, Platform.host_memory)."""
        self._staged = not host_memory
        self._tp_backends = backends.tp
        if backends.stages != GLOO:
            self.stages = self._group("stages", backends.stages, self.rank - 1, num_workers)

    def stage_group(self, stage: int, tp_rank: int, tp: int) -> dist.ProcessGroup:
        """The tensor-parallel group of `stage` (its T ranks only; the engine is not a member). Built after
        the stage's INIT, when every member knows the layout; waits for the others like the groups above."""
        backend = self._tp_backends[stage] if self._tp_backends else GLOO
        return self._group(f"tp{stage}", backend, tp_rank, tp)

    @staticmethod
    @_gloo
    def wait(work) -> None:
        """Wait for a send or receive with no time limit. Never pass a short timeout to a gloo wait: a timed
        out wait closes the connection to that peer, and is_completed() stays False until someone waits."""
        work.wait(FOREVER)

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

    @_gloo
    def isend_packed(self, group: dist.ProcessGroup, packed: list[torch.Tensor], dst: int) -> list:
        return [group.send([t], dst, i) for i, t in enumerate(packed)]

    def recv_obj(self, group: dist.ProcessGroup, src: int,
                 wait: Callable[[object], None] | None = None) -> tuple[int, object]:
        """`wait`: how to wait on each receive (the engine waits in a helper thread, see pipeline.py)."""
        wait = wait or self.wait
        slab = torch.empty(self.SLAB, dtype=torch.uint8)
        wait(_gloo(group.recv)([slab], src, 0))
        kind, n = slab[:16].view(torch.int64).tolist()
        if n + 16 <= self.SLAB:
            return kind, pickle.loads(slab[16:16 + n].numpy().tobytes())
        payload = torch.empty(n, dtype=torch.uint8)
        wait(_gloo(group.recv)([payload], src, 1))
        return kind, pickle.loads(payload.numpy().tobytes())

    def send_obj(self, group: dist.ProcessGroup, kind: int, obj: object, dst: int) -> None:
        for w in self.isend_packed(group, self.pack(kind, obj), dst):
            self.wait(w)

    # -- tensors (activations, results) -------------------------------------------------------------------
    # On CPU both are one gloo call, as before (one bool and one None test added).
    @_gloo
    def isend(self, t: torch.Tensor, dst: int, tag: int):
        if self.stages is not None and dst != ENGINE:
            return self.stages.send([t], dst - 1, tag)  # NCCL orders sends per pair; the tag is ignored
        if self._staged:
            return staged_send(self.data, t, dst, tag)
        return self.data.send([t], dst, tag)

    @_gloo
    def irecv(self, t: torch.Tensor, src: int, tag: int):
        if self.stages is not None and src != ENGINE:
            return self.stages.recv([t], src - 1, tag)
        if self._staged:
            return staged_recv(self.data, t, src, tag)
        return self.data.recv([t], src, tag)


def tensor_tag(batch_id: int) -> int:
    """One tag per micro-batch for activations and results, so nothing relies on posting order."""
    return 16 + batch_id % (1 << 30)


def head_tag(batch_id: int) -> int:
    """The normalised rows the last stage sends the first for its part of a split lm_head."""
    return 16 + (1 << 30) + batch_id % (1 << 29)
