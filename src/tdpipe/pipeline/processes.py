"""The stage processes' lifecycle, apart from the data path (pipeline/executor.py): start, watch, stop, kill.

Launch: by default the engine starts the stages itself (`python -m tdpipe.pipeline.stage`) on this machine,
each in its own process group, so a Ctrl-C in the terminal reaches the engine alone; the stages exit when
the engine does, however it dies (each watches the engine's pidfd, pipeline/stage.py). Under torchrun
(env:// variables set) rank 0 is the engine and ranks 1..P x T are the workers, on any nodes (a stage's T
ranks best on one node: they all-reduce every layer); run_stage_if_worker turns a rank > 0 into a stage.

Nothing is left behind: a watchdog thread blocks on the spawned stages' pidfds, and the first exit that is
not part of a shutdown becomes `failure` (which stage, how it died, and the reason it wrote into the
store, if any) while the rest are killed at once. The executor looks at `failure` between the short
slices of every wait, so a dead stage fails the run within a fraction of a second. Under torchrun the
engine sees no exit codes; `reported()` reads the reasons the stages wrote into the store.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time

from tdpipe.interrupt import deferred_sigint
from tdpipe.pipeline import prefork, zygote
from tdpipe.pipeline.wire.layout import Layout
from tdpipe.pipeline.wire.transport import (Rendezvous, failure_reason, serve_rendezvous, torchrun_env,
                                            torchrun_rendezvous)

_KILL_WAIT = 5.0  # seconds to reap a killed stage


class StageProcesses:
    """The worker ranks (1..P x T) of one pipeline: spawned here, or already running under torchrun."""

    def __init__(self, layout: Layout, threads: list[int], cpus: list[int] | None = None) -> None:
        self.layout = layout
        self.threads = threads  # per stage: its ranks' compute threads (OMP_NUM_THREADS)
        self.cpus = cpus  # the cores every spawned rank pins itself to (its --cpus); None: not pinned
        # spawned (or forked) worker ranks 1..W-1, in order; none under torchrun
        self.procs: list[subprocess.Popen | prefork.StageHandle] = []
        self.launcher = ""  # "spawn" or "torchrun"
        self.rendezvous: Rendezvous | None = None
        self.failure: str | None = None  # the watchdog's verdict: the stage that died first, and how
        self._stopping = False
        self._watchdog: threading.Thread | None = None

    def start(self) -> Rendezvous:
        """The rendezvous of the engine (rank 0) and its workers: torchrun's, or a store served on the
        loopback for the stages spawned here."""
        lay = self.layout
        world = lay.world_size
        if torchrun_env():
            rv = torchrun_rendezvous()
            if rv.world_size != world:
                raise ValueError(f"torchrun started {rv.world_size} processes; pipeline_parallel_size "
                                 f"{lay.pp} x tensor_parallel_size {lay.tp} needs {world} (the engine plus one "
                                 "per stage and tensor-parallel rank)")
            self.rendezvous, self.launcher = rv, "torchrun"
            return rv
        rv, port = serve_rendezvous(world)
        self.rendezvous, self.launcher = rv, "spawn"
        self.spawn(port)
        return rv

    def spawn(self, port: int) -> None:
        """Start every worker rank on this machine, then the watchdog."""
        world = self.layout.world_size
        for r in self.layout.worker_ranks():
            threads = self.threads[self.layout.coords(r)[0]]
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            argv = ["--master", f"127.0.0.1:{port}", "--rank", str(r), "--world-size", str(world),
                    "--parent", str(os.getpid())]
            if self.cpus:
                argv += ["--cpus", ",".join(map(str, self.cpus))]
            # a blank stage forked at the process's start if there is one (pipeline/prefork.py), else one the
            # process's zygote forks (pipeline/zygote.py), else a fresh interpreter; each in its own process
            # group: the terminal's Ctrl-C goes to the engine only, which stops the stages. That Ctrl-C waits
            # until the stage is in self.procs: one raised between its start and the append would leave a
            # running stage that kill() does not know (it then met the closed rendezvous store and printed
            # torch's C++ warnings into the engine's stderr before it noticed the engine was gone)
            with deferred_sigint():
                proc = prefork.take(argv, env) or zygote.fork(argv, env) or subprocess.Popen(
                    [sys.executable, "-m", "tdpipe.pipeline.stage"] + argv, env=env, stdin=subprocess.DEVNULL,
                    process_group=0)
                self.procs.append(proc)
        self._watchdog = threading.Thread(target=self._watch, name="tdpipe-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        """Block on the stages' pidfds (no polling): the first exit that is not a shutdown fails the run."""
        fds = {}
        for k, p in enumerate(self.procs):
            try:
                fds[os.pidfd_open(p.pid)] = k
            except (OSError, AttributeError):
                fds = {}
                break
        try:
            while not self._stopping:
                if fds:
                    ready, _, _ = select.select(list(fds), [], [], 1.0)
                else:
                    time.sleep(0.2)
                    ready = []
                # blame the stage that went first: those select() reported, and a signal over an exit code
                # (a stage whose neighbour died exits with 1 a moment later)
                first = [fds[fd] for fd in ready]
                order = first + [k for k in range(len(self.procs)) if k not in first]
                dead = [(k, self.procs[k].poll()) for k in order if self.procs[k].poll() is not None]
                dead.sort(key=lambda kr: kr[1] >= 0)
                if dead and not self._stopping:
                    k, rc = dead[0]  # procs[k] is worker rank k + 1
                    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
                    why = failure_reason(self.rendezvous.store, k + 1) if self.rendezvous is not None else None
                    rank = f", rank {k + 1}" if self.layout.tp > 1 else ""
                    self.failure = (f"pipeline {self.layout.name(k + 1)} (pid {self.procs[k].pid}{rank}) {how}"
                                    + (f" ({why})" if why else "")
                                    + "; the run is aborted and the other stages stopped")
                    self.kill()
                    return
        finally:
            for fd in fds:
                os.close(fd)

    def verdict(self, timeout: float) -> str | None:
        """The watchdog's verdict, given up to `timeout` seconds to come: a connection that broke is
        usually a stage that died a moment ago, and naming that stage beats "the connection closed"."""
        if self._watchdog is not None and self.failure is None:
            self._watchdog.join(timeout=timeout)
        return self.failure

    def reported(self) -> str | None:
        """The first failure a stage wrote into the store (torchrun: the engine cannot see exit codes)."""
        if self.rendezvous is None:
            return None
        for r in self.layout.worker_ranks():
            why = failure_reason(self.rendezvous.store, r)
            if why:
                return why
        return None

    def stopping(self) -> None:
        """The engine is shutting the stages down: from now on an exit is expected, not a failure."""
        self._stopping = True

    def wait(self, timeout: float) -> None:
        """Give the spawned stages up to `timeout` seconds in all to exit (after STOP)."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def kill(self) -> None:
        """SIGKILL every spawned stage still running, and reap them."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=_KILL_WAIT)
            except subprocess.TimeoutExpired:
                pass


def run_stage_if_worker(pipeline_parallel_size: int, tensor_parallel_size: int = 1) -> None:
    """Under torchrun, ranks other than 0 become stage workers here and exit when the engine stops them,
    so the same script (or `tdpipe generate --pp P --tensor-parallel-size T`) runs on every rank."""
    if pipeline_parallel_size * tensor_parallel_size <= 1 or not torchrun_env() or int(os.environ["RANK"]) == 0:
        return
    from tdpipe.pipeline import stage

    try:
        stage.serve(torchrun_rendezvous())
    except KeyboardInterrupt:  # Ctrl-C reaches every rank under torchrun: the engine reports it
        os._exit(130)
    except BaseException:  # noqa: BLE001
        stage._fatal(f"stage rank {os.environ['RANK']}")
    os._exit(0)


__all__ = ["StageProcesses", "run_stage_if_worker"]
