"""Stage processes forked from the engine's process while it is still blank, instead of spawned as fresh
interpreters: a spawned stage imports torch again (1.3 s of CPU on the AVX-512 machines, 3 s on the AVX2
EPYC), on cores the engine is loading its own model on.

`reserve(n)` forks n blank stages at a point where the process has imported torch and nothing else has
happened: one thread, no OpenMP region run (its thread pool does not survive a fork), no CUDA, no sockets
(zmq's I/O threads), no open files of the run. Each blank stage waits on a pipe for its command line; the
engine's StageProcesses hands one its `tdpipe.pipeline.stage` argv and environment where it would have
spawned one (`take()`), and it runs the very code a spawned stage runs, in its own process group, named as
a spawned stage is (`ps` and /proc show `python -m tdpipe.pipeline.stage ...`). A blank stage nobody takes
exits when the engine closes its pipe (`release()`) or dies (the pipe's end of file). Where the process
is not blank (an `LLM` built inside a program that has computed or started threads) nothing is reserved
and the stages are spawned as before.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time

from tdpipe.config import ParallelConfig
from tdpipe.pipeline.wire.transport import torchrun_env

_reserve: list[tuple[int, int]] = []  # (pid, write end of its pipe), oldest first
_ENV = "TDPIPE_PREFORK"  # "0": never fork stages (spawn every one, as torchrun-less runs did before)


class StageHandle:
    """A forked stage as the lifecycle code sees a subprocess.Popen: pid, poll, wait, kill, returncode.
    Subclasses say how the exit code is learnt (poll, wait); signals go to the pid while it runs."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkedStage(StageHandle):
    """A stage forked by this process: its own child, reaped with waitpid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()  # the watchdog thread polls while the engine waits

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: gone, its status lost
                    self.returncode = -signal.SIGKILL
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"stage pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


def enabled() -> bool:
    return os.environ.get(_ENV, "1") != "0"


def blank() -> bool:
    """Whether this process may fork stages now: one thread of Python's own, torch imported (what the
    fork saves) but no OpenMP pool, and no CUDA build (a forked child cannot use CUDA its parent touched;
    on such builds the stages are spawned)."""
    if not enabled() or threading.active_count() != 1 or "torch" not in sys.modules:
        return False
    import torch

    return not torch.backends.cuda.is_built() and not torch.distributed.is_initialized()


def stages_for(parallel: ParallelConfig) -> int:
    """How many stage processes an engine with this layout starts on this machine: P x T (none under
    torchrun, which starts them; none at P x T = 1), or one per disaggregated instance; data-parallel
    replicas are engine cores of their own, each reserving for itself."""
    if torchrun_env() or parallel.data_parallel_size > 1:
        return 0
    if parallel.disaggregation == "pd":
        return parallel.prefill_workers + parallel.decode_workers
    return parallel.world_size if parallel.world_size > 1 else 0


def reserve(n: int) -> int:
    """Fork up to n blank stages now, if this process is blank; returns how many are in reserve."""
    if n <= len(_reserve) or not blank():
        return len(_reserve)
    sys.stdout.flush()
    sys.stderr.flush()
    for _ in range(n - len(_reserve)):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the blank stage
            os.close(w)
            _wait_and_run(r)  # never returns
        os.close(r)
        os.set_inheritable(w, False)
        _reserve.append((pid, w))
    return len(_reserve)


def reserved() -> int:
    """Blank stages waiting in this process."""
    return len(_reserve)


def take(argv: list[str], env: dict[str, str]) -> ForkedStage | None:
    """A reserved stage given its command line (`python -m tdpipe.pipeline.stage` argv) and environment,
    or None when none is reserved (the caller spawns one)."""
    while _reserve:
        pid, w = _reserve.pop(0)
        try:
            os.write(w, pickle.dumps((argv, env)))
        except OSError:  # died while waiting (killed): reap it, try the next
            _reap(pid)
            continue
        finally:
            os.close(w)
        return ForkedStage(pid)
    return None


def release() -> None:
    """The blank stages nobody took exit (end of file on their pipe) and are reaped."""
    while _reserve:
        pid, w = _reserve.pop()
        os.close(w)
        _reap(pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _wait_and_run(r: int) -> None:
    """The blank stage's life: its command line from the pipe, then the stage's (never returns)."""
    try:
        os.setpgid(0, 0)  # at once: a Ctrl-C to the engine's group while it waits must not reach it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # no fd of the engine's but this pipe: a blank stage forked later holds the write ends of the pipes
        # of those forked before it, whose end of file must not wait for it
        os.closerange(3, r)
        os.closerange(r + 1, _max_fd())
        data = b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
        os.close(r)
    except BaseException:  # noqa: BLE001
        os._exit(1)
    if not data:  # released, or the engine is gone
        os._exit(0)
    argv, env = pickle.loads(data)
    run_stage(argv, env)


def run_stage(argv: list[str], env: dict[str, str], adopted: bool = False, cpus: set[int] | None = None,
              stdio: tuple[int, int] | None = None) -> None:
    """Become the stage a spawned interpreter would be, in a freshly forked child (here, or in the engine's
    zygote: `adopted`): its own process group, stdin from /dev/null, the engine's stdout and stderr (`stdio`,
    else the forker's), no other fd of the forker, its name, its environment, the cores it would have
    inherited (`cpus`), then the stage's main. Always os._exit: the forker's exit functions are not the
    stage's to run."""
    code = 1
    try:
        os.setpgid(0, 0)  # as Popen(process_group=0): the terminal's Ctrl-C goes to the engine only
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        if stdio is not None:
            os.dup2(stdio[0], 1)
            os.dup2(stdio[1], 2)
        os.closerange(3, _max_fd())
        _name(argv)  # before the environment changes: setproctitle finds the argv area through environ
        os.environ.clear()
        os.environ.update(env)
        if cpus:
            os.sched_setaffinity(0, cpus)
        from tdpipe.pipeline import stage

        sys.argv = [stage.__file__] + argv
        code = stage.main(argv, adopted=adopted)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - a stage's own failures are reported by stage.main
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _name(argv: list[str]) -> None:
    """The process's command line as a spawned stage's, so that `ps`, pgrep and /proc name it a stage."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join([sys.executable, "-m", "tdpipe.pipeline.stage"] + argv))


def _max_fd() -> int:
    try:
        return max(int(x) for x in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return 256


__all__ = ["ForkedStage", "StageHandle", "blank", "release", "reserve", "reserved", "run_stage", "stages_for",
           "take"]
