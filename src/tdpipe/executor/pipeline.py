"""pp > 1: one worker process per stage, the engine as rank 0 (TD-Pipe §3.2 hierarchy controller).

submit() sends a micro-batch's metadata to every stage at once and posts the receive for its result;
collect() waits for the oldest result. Up to pp micro-batches are in flight, so while the engine samples
one batch's tokens the stages compute the others (SiPipe §5.1).

Launch: by default the engine starts the stages itself (`python -m tdpipe.worker.stage`) on this machine.
Under torchrun (env:// variables set) rank 0 is the engine and ranks 1..pp are the stages, on any nodes.
A watchdog thread waits on the stage processes; when one dies the engine fails the run with that stage's
exit code and kills the rest, so nothing hangs and nothing is left behind.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from tdpipe.core.batch import StepInput
from tdpipe.core.block_sync import BlockTableSender
from tdpipe.executor import messages as m
from tdpipe.executor.base import Executor, StepResult
from tdpipe.executor.transport import (Transport, serve_rendezvous, tensor_tag, torchrun_env,
                                       torchrun_rendezvous)


class PipelineError(RuntimeError):
    """A stage died or the pipeline broke; the run cannot continue."""


@dataclass
class StageSpec:
    start_layer: int
    end_layer: int
    threads: int


@dataclass
class _InFlight:
    step: StepInput
    work: object
    buf: torch.Tensor
    greedy: bool
    submitted: float


class PipelineExecutor(Executor):
    def __init__(self, model_config, model_path: str, dtype: torch.dtype, num_blocks: int, block_size: int,
                 stages: list[StageSpec], max_num_batched_tokens: int, device: str = "cpu") -> None:
        self.num_stages = len(stages)
        self.stages = stages
        self.vocab = model_config.vocab_size
        self.dtype = dtype
        self.procs: list[subprocess.Popen] = []
        self._failure: str | None = None
        self._closing = False
        self._dead = False
        self.sender = BlockTableSender()
        self._inflight: deque[_InFlight] = deque()
        self._pending_sends: deque = deque()
        world = self.num_stages + 1
        if torchrun_env():
            rv = torchrun_rendezvous()
            if rv.world_size != world:
                raise ValueError(f"torchrun started {rv.world_size} processes; pipeline_parallel_size "
                                 f"{self.num_stages} needs {world} (the engine plus one per stage)")
            self.launcher = "torchrun"
        else:
            rv, port = serve_rendezvous(world)
            self.launcher = "spawn"
            self._spawn(port, world)
        self.t = Transport(rv)
        dname = "bfloat16" if dtype == torch.bfloat16 else "float32"
        for k, s in enumerate(stages):
            init = m.StageInit(k, self.num_stages, s.start_layer, s.end_layer, model_config, model_path, dname,
                               num_blocks, block_size, s.threads, device, max_num_batched_tokens)
            self._send_all([k], m.INIT, init)
        self.stage_pids = []
        for k in range(self.num_stages):
            kind, info = self._reply(k)
            if kind != m.READY:
                self._fail(str(info), reported=True)
            self.stage_pids.append(info["pid"])

    # -- processes ---------------------------------------------------------------------------------------
    def _spawn(self, port: int, world: int) -> None:
        for k, s in enumerate(self.stages):
            env = dict(os.environ, OMP_NUM_THREADS=str(s.threads))
            cmd = [sys.executable, "-m", "tdpipe.worker.stage", "--master", f"127.0.0.1:{port}",
                   "--rank", str(k + 1), "--world-size", str(world), "--parent", str(os.getpid())]
            self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
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
            while not self._closing:
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
                if dead and not self._closing:
                    k, rc = dead[0]
                    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
                    self._failure = (f"pipeline stage {k} (pid {self.procs[k].pid}) {how}; "
                                     "the run is aborted and the other stages stopped")
                    self._kill_all()
                    return
        finally:
            for fd in fds:
                os.close(fd)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def _fail(self, why: str | None = None, reported: bool = False) -> None:
        """Turn a broken pipe, closed connection or dead stage into one clear error, after cleaning up.
        `reported`: `why` is the stage's own account (it failed to start), better than an exit code."""
        if self.procs and self._failure is None and not reported:
            self._watchdog.join(timeout=3)  # the watchdog names the stage that died
        msg = why if reported else self._failure or why or (
            "the pipeline broke (a stage on another node died or is unreachable)")
        self._dead = True
        self.shutdown()
        raise PipelineError(msg)

    # -- messaging ---------------------------------------------------------------------------------------
    def _send_all(self, stages: list[int], kind: int, obj: object, packed=None) -> None:
        packed = packed or self.t.pack(kind, obj)
        try:
            for k in stages:
                works = self.t.isend_packed(self.t.ctrl, packed, k + 1)
                self._pending_sends.append((works, packed))
        except RuntimeError as e:
            self._fail(f"sending to the stages failed: {e}")
        while self._pending_sends and all(w.is_completed() for w in self._pending_sends[0][0]):
            self._pending_sends.popleft()

    def _reply(self, k: int) -> tuple[int, object]:
        try:
            return self.t.recv_obj(self.t.reply, k + 1)
        except RuntimeError as e:
            self._fail(f"stage {k} stopped answering: {e}")
            raise  # unreachable

    def release(self, seq_ids: list[int]) -> None:
        self.sender.release(seq_ids)

    # -- Executor ----------------------------------------------------------------------------------------
    def submit(self, step: StepInput) -> None:
        if self._dead:
            raise PipelineError(self._failure or "the pipeline was shut down")
        greedy = bool(step.greedy_rows) and all(step.greedy_rows)
        deltas = self.sender.deltas(step.seq_ids, step.kv_epochs, step.block_tables)
        msg = m.StepMessage(step.batch_id, step.token_ids, step.query_lens, step.seq_lens, step.seq_ids,
                            deltas, self.sender.take_freed(), step.is_prefill, greedy, step.shape(), time.time())
        n = len(step.query_lens)
        buf = torch.empty(n, dtype=torch.int64) if greedy else torch.empty(n, self.vocab, dtype=self.dtype)
        try:
            work = self.t.irecv(buf, self.num_stages, tensor_tag(step.batch_id))  # last stage's rank = pp
        except RuntimeError as e:
            self._fail(f"posting the result receive failed: {e}")
        self._inflight.append(_InFlight(step, work, buf, greedy, time.time()))
        self._send_all([0], m.STEP, msg)  # the first stage needs the token ids
        if self.num_stages > 1:
            msg.token_ids = []
            self._send_all(list(range(1, self.num_stages)), m.STEP, msg)

    def collect(self) -> StepResult:
        f = self._inflight.popleft()
        try:
            f.work.wait()
        except RuntimeError as e:
            self._fail(f"waiting for the last stage failed: {e}")
        done = time.time()
        res = StepResult(f.step.batch_id, timings={"submit": f.submitted, "done": done})
        if f.greedy:
            res.token_ids = f.buf.tolist()
        else:
            res.logits = f.buf.float() if f.buf.dtype != torch.float32 else f.buf
        return res

    def trace_events(self) -> list[list[dict]]:
        """Collect every stage's trace events since the last call (absolute time.time() stamps)."""
        if self._dead:
            return [[] for _ in self.stages]
        self._send_all(list(range(self.num_stages)), m.TRACE, None)
        out = []
        for k in range(self.num_stages):
            kind, events = self._reply(k)
            out.append(events if kind == m.TRACE_DATA else [])
        return out

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if not self._dead:
            try:
                self._send_all(list(range(self.num_stages)), m.STOP, None)
                for works, _ in self._pending_sends:
                    for w in works:
                        w.wait()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        deadline = time.time() + 5
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        self._kill_all()
        self._dead = True


def run_stage_if_worker(pipeline_parallel_size: int) -> None:
    """Under torchrun, ranks other than 0 become stage workers here and exit when the engine stops them,
    so the same script (or `tdpipe generate --pp N`) runs on every rank."""
    if pipeline_parallel_size <= 1 or not torchrun_env() or int(os.environ["RANK"]) == 0:
        return
    from tdpipe.worker import stage

    try:
        stage.serve(torchrun_rendezvous())
    except BaseException:  # noqa: BLE001
        stage._fatal(f"stage rank {os.environ['RANK']}")
    os._exit(0)


__all__ = ["PipelineExecutor", "PipelineError", "StageSpec", "run_stage_if_worker"]
