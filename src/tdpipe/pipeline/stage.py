"""A pipeline stage worker process: one rank of a stage's tensor-parallel group, running the stage's
data path (pipeline/stage_worker.py) until the engine stops it.

Run as `python -m tdpipe.pipeline.stage --master HOST:PORT --rank R --world-size W --parent PID` (the
engine spawns these), or by torchrun through tdpipe.pipeline.processes.run_stage_if_worker.

A spawned stage belongs to the engine: it runs in its own process group and ignores SIGINT (a Ctrl-C in
the terminal is the engine's to handle; the engine then stops the stages), and a thread waits on the
engine's pidfd and exits the moment the engine is gone, however it died. A stage that fails writes one
line saying why into the rendezvous store, which the engine reports in its PipelineError; the stage prints
at most that line itself (the traceback too with TDPIPE_DEBUG=1).
"""
from __future__ import annotations

import argparse
import datetime
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from tdpipe.pipeline.stage_worker import StageWorker
from tdpipe.pipeline.wire.groups import GroupBackends
from tdpipe.pipeline.wire import messages as m
from tdpipe.pipeline.wire.layout import ENGINE, Layout
from tdpipe.pipeline.wire.transport import PeerLost, Rendezvous, Transport, join_rendezvous, report_failure
from tdpipe.platforms import get_platform

_failure_store: Rendezvous | None = None  # where _fatal reports (set once the store is joined)
_parent: int | None = None  # the engine's pid, for a stage the engine spawned
_parent_fd: int | None = None  # its pidfd, for a stage the engine's zygote forked (its parent is the zygote)


def _debug() -> bool:
    return os.environ.get("TDPIPE_DEBUG", "") not in ("", "0")


def _engine_gone() -> bool:
    if _parent_fd is not None:  # a zygote's child: the engine is not its parent
        return bool(select.select([_parent_fd], [], [], 0)[0])
    return _parent is not None and os.getppid() != _parent


def _fatal(where: str, reason: str | None = None) -> None:
    """A stage that fails exits at once: the engine sees the exit (or the closed connection) and fails the
    run within seconds, rather than waiting on a stage that will never answer."""
    _tell(where, reason)
    os._exit(1)


def _tell(where: str, reason: str | None = None) -> None:
    """Say why this stage fails, once. The reason goes into the store for the engine's error message; this
    process prints it (one line) only where the engine may not show it: under torchrun, or if the store
    could not take it; the traceback too with TDPIPE_DEBUG=1. A stage whose engine is gone says nothing
    (its errors are only the engine's connections closing)."""
    exc = sys.exc_info()[1]
    if isinstance(exc, PeerLost) and _parent is not None and not _debug():
        # another process died: the engine's watchdog stops this stage within moments, or, if it was the
        # engine, the parent watch ends it; only a stage still here after that has something to say
        time.sleep(1.0)
    if reason is None:
        reason = f"{where} failed: {type(exc).__name__}: {exc}" if exc is not None else f"{where} failed"
    reason = " ".join(reason.split())
    if _engine_gone():
        return
    rv = _failure_store
    reported = rv is not None and report_failure(rv.store, rv.rank, reason)
    if _debug():
        print(f"tdpipe: {reason}", file=sys.stderr)
        traceback.print_exc()
    elif not reported or _parent is None:
        print(f"tdpipe: {reason}", file=sys.stderr)
    sys.stderr.flush()


def serve(rv: Rendezvous, abort: Callable[[], None] | None = None) -> None:
    """Join the pipeline as a stage: receive StageInit (it names the device and the groups' backends),
    build, acknowledge, run until STOP.
    `abort`: called while the groups are being built, may raise to give up."""
    global _failure_store
    _failure_store = rv
    t = Transport(rv, abort)
    kind, init = t.recv_obj(t.ctrl, ENGINE)
    if kind != m.INIT:
        raise RuntimeError(f"stage rank {rv.rank}: expected INIT from the engine, got message kind {kind}")
    layout = Layout(init.num_stages, init.tp_size)
    name = layout.name(rv.rank)
    try:
        platform = get_platform(init.device)
        # threads, the host heap (activations of varying size every step, tdpipe/malloc.py) and the device
        # allocator, before the model's first tensor
        platform.configure_process(init.threads)
        platform.set_device(rv.rank - 1)  # the engine chose init.device by the same worker index
        t.use_backends(GroupBackends(init.stage_backend, init.tp_backends), platform.host_memory,
                       layout.num_workers)
        worker = StageWorker(t, init, _fatal)
    except Exception as e:  # noqa: BLE001 - one clear line to the engine, no traceback here
        reason = f"{name} failed to start: {e!r}"
        _tell(f"{name} (start-up)", reason)  # first: the engine stops this process on FAILED
        try:  # the engine may be waiting on another stage's reply first: the store carries the reason too
            for w in t.isend_packed(t.reply, t.pack(m.FAILED, reason), ENGINE):
                w.wait(datetime.timedelta(seconds=2))
        except Exception:  # noqa: BLE001
            pass
        os._exit(1)
    t.send_obj(t.reply, m.READY, {"pid": os.getpid(), "stage": init.stage, "tp_rank": init.tp_rank}, ENGINE)
    try:
        worker.run()
    except Exception:  # noqa: BLE001
        _fatal(f"{name} (compute)")


def _watch_parent(parent: int, adopted: bool = False) -> None:
    """A spawned stage must not outlive the engine (no orphans), however the engine dies (SIGKILL
    included). A thread blocks on the engine's pidfd (polls getppid() where pidfds are missing) and exits
    the process when it fires. Not PR_SET_PDEATHSIG: that fires when the *thread* that spawned the stage
    exits, which kills the stages of an engine built in a short-lived thread. An `adopted` stage (forked by
    the engine's zygote, pipeline/zygote.py) has the zygote for parent; the zygote checked that the engine
    was alive when it forked, and the stage needs a pidfd to watch it."""
    global _parent_fd
    if adopted:
        try:
            _parent_fd = os.pidfd_open(parent)
        except OSError:  # the engine is already gone
            os._exit(1)

    def watch() -> None:
        fd = _parent_fd
        if fd is None:
            try:
                fd = os.pidfd_open(parent)
            except (OSError, AttributeError):
                pass
            if os.getppid() != parent:  # after pidfd_open: the fd, if any, is the engine's
                os._exit(1)
        if fd is not None:
            select.select([fd], [], [])
        else:
            while os.getppid() == parent:
                time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="tdpipe-parent", daemon=True).start()


def main(argv: list[str] | None = None, adopted: bool = False) -> int:
    """The stage's life from its command line; `adopted`: forked by the engine's zygote, not the engine."""
    global _parent
    p = argparse.ArgumentParser(description="tdpipe pipeline stage worker (started by the engine)")
    p.add_argument("--master", required=True, help="HOST:PORT of the engine's rendezvous store")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--parent", type=int, default=None, help="engine pid: exit when it is gone")
    p.add_argument("--cpus", default=None, help="comma-separated cores to pin this process to (default: not pinned)")
    a = p.parse_args(argv)
    # Ctrl-C is the engine's to handle; a write to the terminal from this background process group must
    # not stop the stage (`stty tostop`)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    if a.parent is not None:
        _parent = a.parent
        _watch_parent(a.parent, adopted)
    if a.cpus:  # its own cores (a disaggregated instance: core/pd_parts.py)
        os.sched_setaffinity(0, {int(c) for c in a.cpus.split(",")})
    host, port = a.master.rsplit(":", 1)
    try:
        serve(join_rendezvous(host, int(port), a.rank, a.world_size))
    except BaseException:  # noqa: BLE001
        _fatal(f"stage rank {a.rank}")
    os._exit(0)  # skip interpreter teardown with gloo threads alive


if __name__ == "__main__":
    sys.exit(main())
