"""The engine's zygote: one helper process that has imported torch and the stage's code and forks stages on
request, for engines in processes that are no longer blank (an `LLM` built inside a program that has
computed, started threads or built other engines: pipeline/prefork.py cannot fork those safely).

Every spawned stage imports torch again (1.3 s of CPU on the AVX-512 machines, 3 s on the AVX2 EPYC); with
the zygote a process pays that import once, however many pipelines it builds: the zygote is started by the
first engine that needs stages (`warm()`, at the start of its build, so that its import overlaps the
engine's own start) and serves every later one of the process. It stays blank itself (one thread, nothing
computed: a fork of it is a clean stage), sleeps in select() between requests, and exits when its engine
process does (its request pipe's end of file, or the engine's pidfd) or after IDLE_EXIT_S (5 minutes) without
a stage of its own alive, so a program that built a pipeline once does not keep an interpreter with torch
for the rest of its life; the next engine then starts a new zygote.

A forked stage runs the same main as a spawned one (pipeline/prefork.run_stage), named and grouped the
same; its parent is the zygote, so it watches the engine through a pidfd (stage.py, `adopted`). The
zygote reaps it and reports its exit code; the engine sees it through `ZygoteStage`, which answers as a
subprocess.Popen does (poll, wait, kill, returncode). Switched off with the forked stages
(TDPIPE_PREFORK=0) and on CUDA builds of torch, where the stages are spawned.

Run as `python -m tdpipe.pipeline.zygote --parent PID --reply-fd FD` (the engine starts it).
"""
from __future__ import annotations

import os
import pickle
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from tdpipe.pipeline import prefork

_START_TIMEOUT = 180.0  # seconds for the zygote's imports and its first fork (a loaded 2-core machine)
# seconds a zygote with no stage of its own alive waits before it exits (the next engine starts another)
IDLE_EXIT_S = 300.0
_HEADER = struct.Struct("!I")


def _frame(obj: object) -> bytes:
    """One message: its length, then its pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _send(fd: int, obj: object) -> None:
    data = _frame(obj)
    while data:
        data = data[os.write(fd, data):]


class _Reader:
    """Length-prefixed pickles from a pipe, or from a Unix socket with the fds sent beside them."""

    def __init__(self, fd: int, sock: socket.socket | None = None) -> None:
        self.fd = fd
        self.sock = sock
        self.buf = b""
        self.fds: list[int] = []  # received, in order, not yet handed out

    def read(self) -> list[object] | None:
        """The whole messages one read brings; None at end of file."""
        if self.sock is not None:
            chunk, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 16)
            self.fds += fds
        else:
            chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buf += chunk
        out = []
        while len(self.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf)
            if len(self.buf) < _HEADER.size + n:
                break
            out.append(pickle.loads(self.buf[_HEADER.size:_HEADER.size + n]))
            self.buf = self.buf[_HEADER.size + n:]
        return out


# -- the engine's side ------------------------------------------------------------------------------------
class ZygoteStage(prefork.StageHandle):
    """A stage the zygote forked: its exit code comes from the zygote, which reaps it."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self._z = zygote

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        return self._z.exit_code(self.pid, 0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._z.exit_code(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"stage pid {self.pid}", timeout)
        return code


class Zygote:
    """The client of this process's zygote: fork requests in, pids and exit codes back (a reader thread)."""

    def __init__(self) -> None:
        self.owner = os.getpid()  # a process forked from this one (multiprocessing) starts its own zygote
        r, w = os.pipe()
        # requests go over a Unix socket, each with the engine's stdout and stderr of the moment beside it:
        # a forked stage writes where a stage spawned then would have (pytest's capture, a redirection)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # in a process group of its own: the terminal's Ctrl-C is the engine's alone
        self.proc = subprocess.Popen([sys.executable, "-m", "tdpipe.pipeline.zygote", "--parent", str(os.getpid()),
                                      "--reply-fd", str(w), "--idle-exit", str(IDLE_EXIT_S)],
                                     stdin=theirs, pass_fds=(w,), process_group=0)
        theirs.close()
        os.close(w)
        os.set_inheritable(r, False)
        self._lock = threading.Lock()  # one request at a time
        self._cond = threading.Condition()
        self._codes: dict[int, int] = {}
        self._started: queue.Queue[int | None] = queue.Queue()
        self._gone = False
        threading.Thread(target=self._read, args=(r,), name="tdpipe-zygote", daemon=True).start()

    def alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def fork(self, argv: list[str], env: dict[str, str]) -> ZygoteStage | None:
        """A stage forked with this command line and environment, on this process's cores; None if the
        zygote could not (it died, or did not start in time): the caller spawns the stage."""
        with self._lock:
            if not self.alive():
                return None
            try:
                data = _frame((argv, env, os.sched_getaffinity(0)))
                sent = socket.send_fds(self.sock, [data], [1, 2])
                self.sock.sendall(data[sent:])
                pid = self._started.get(timeout=_START_TIMEOUT)
            except (OSError, queue.Empty):
                self._gone = True
                return None
            return None if pid is None else ZygoteStage(pid, self)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The stage's exit code once the zygote reaped it; if the zygote itself is gone, a stage that is
        no longer running counts as killed (its code went with the zygote)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while pid not in self._codes:
                if self._gone and not _running(pid):
                    self._codes[pid] = -signal.SIGKILL
                    break
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(0.2 if left is None else min(left, 0.2))
            return self._codes[pid]

    def _read(self, fd: int) -> None:
        rd = _Reader(fd)
        try:
            while (msgs := rd.read()) is not None:
                for kind, pid, code in msgs:
                    if kind == "started":
                        self._started.put(pid)
                    else:
                        with self._cond:
                            self._codes[pid] = code
                            self._cond.notify_all()
        except OSError:
            pass
        finally:
            self._gone = True
            self._started.put(None)
            with self._cond:
                self._cond.notify_all()
            os.close(fd)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def usable() -> bool:
    """Stages may come from a zygote here: the forked stages are on, and torch has no CUDA build."""
    if not prefork.enabled():
        return False
    import torch

    return not torch.backends.cuda.is_built()


def warm() -> None:
    """Start this process's zygote now if it has none, so that its imports overlap the engine's start."""
    global _zygote
    if not usable():
        return
    with _zygote_lock:
        if _zygote is None or _zygote.owner != os.getpid() or not _zygote.alive():
            _zygote = Zygote()


def fork(argv: list[str], env: dict[str, str]) -> ZygoteStage | None:
    """A stage from this process's zygote (started now if need be), or None: the caller spawns it."""
    if not usable():
        return None
    warm()
    z = _zygote
    return z.fork(argv, env) if z is not None else None


# -- the zygote's side ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="tdpipe stage zygote (started by an engine process)")
    p.add_argument("--parent", type=int, required=True, help="the engine's pid: exit when it is gone")
    p.add_argument("--reply-fd", type=int, required=True, help="pipe for pids and exit codes")
    p.add_argument("--idle-exit", type=float, default=IDLE_EXIT_S,
                   help="exit after this many seconds with no stage of its own alive (default: %(default)s)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's to handle
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        parent = os.pidfd_open(a.parent)
    except OSError:
        return 1
    import torch  # noqa: F401 - what every stage forked from here does not import again

    from tdpipe.pipeline import stage  # noqa: F401 - nor the stage's code (the model, the transport)

    requests = _Reader(0, socket.socket(fileno=0))
    kids: dict[int, int] = {}  # pidfd -> pid
    while True:
        # idle (no stage alive): exit after a while rather than hold an interpreter with torch for the rest of
        # the program; a request that crosses the exit gets no reply and the engine spawns that stage itself
        ready = select.select([0, parent, *kids], [], [], None if kids else a.idle_exit)[0]
        if not ready:
            return 0
        if parent in ready:
            return 0  # the engine is gone; its stages watch it themselves
        for fd in [f for f in ready if f in kids]:
            pid = kids.pop(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            _send(a.reply_fd, ("exit", pid, os.waitstatus_to_exitcode(status)))
        if 0 in ready:
            msgs = requests.read()
            if msgs is None:
                return 0  # the engine closed its end: it is exiting
            for stage_argv, env, cpus in msgs:
                stdio = (requests.fds.pop(0), requests.fds.pop(0))  # the engine's stdout and stderr
                pid = os.fork()
                if pid == 0:
                    prefork.run_stage(stage_argv, env, adopted=True, cpus=cpus, stdio=stdio)  # never returns
                for fd in stdio:
                    os.close(fd)
                kids[os.pidfd_open(pid)] = pid
                _send(a.reply_fd, ("started", pid, None))


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Zygote", "ZygoteStage", "fork", "usable", "warm"]
