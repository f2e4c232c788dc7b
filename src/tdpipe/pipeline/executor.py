"""pp > 1 or tp > 1, the engine side of the data path: the engine is rank 0 (TD-Pipe §3.2 hierarchy
controller) of one worker process per (stage, tp rank); tdpipe/pipeline/wire/layout.py numbers the ranks
and names the peers, pipeline/processes.py starts, watches and kills the processes.

submit() sends a micro-batch's metadata to every stage at once and posts the receive for its result;
collect() waits for the oldest result. Up to pp micro-batches are in flight, so while the engine samples
one batch's tokens the stages compute the others (SiPipe §5.1).

Nothing hangs: when a stage dies the engine fails the run with a PipelineError naming it (the watchdog's
verdict, pipeline/processes.py). The engine's main thread never blocks in C++: the gloo groups are built
in a helper thread over a store whose waits poll, and every wait on a message runs in a waiter thread
while the main thread waits on an Event in short slices, checking the watchdog and taking Ctrl-C
(KeyboardInterrupt) within a fraction of a second. After a KeyboardInterrupt out of collect(), drain()
empties the pipeline so the next submit() starts clean.
"""
from __future__ import annotations

import atexit
import queue
import subprocess
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import NoReturn

import torch

from tdpipe.executor.base import Executor, StepResult, host_logits
from tdpipe.interrupt import deferred_sigint
from tdpipe.pipeline.processes import StageProcesses
from tdpipe.pipeline.wire import messages as m
from tdpipe.pipeline.wire.block_sync import BlockTableSender
from tdpipe.pipeline.wire.layout import Layout
from tdpipe.pipeline.wire.groups import choose_backends
from tdpipe.pipeline.wire.transport import Rendezvous, Transport, tensor_tag
from tdpipe.platforms.interface import Platform
from tdpipe.step_input import StepInput

_SLICE = 0.1  # seconds: how often a waiting main thread looks at the watchdog's verdict
_STOP_GRACE = 5.0  # seconds the stages get to leave on STOP before they are killed
_VERDICT = 3.0  # seconds a broken connection waits for the watchdog to name the stage that died
_JOIN = 5.0  # seconds to wait for a helper thread to leave gloo once the stages are gone
_live: weakref.WeakSet[PipelineExecutor] = weakref.WeakSet()


class PipelineError(RuntimeError):
    """A stage (or one tensor-parallel rank of it) died or the pipeline broke; the run cannot continue."""


@dataclass
class StageSpec:
    start_layer: int
    end_layer: int
    threads: int


class _Pending:
    """Works the waiter thread waits on, in order; `done` is set when all finished (or one failed)."""

    __slots__ = ("works", "keep", "done", "error")

    def __init__(self, works: list, keep: object) -> None:
        self.works = works
        self.keep = keep  # the tensors the works read or write stay alive until they finish
        self.done = threading.Event()
        self.error: str | None = None


class _Waiter:
    """Waits on gloo works in a helper thread, one after another in submission order. The engine's main
    thread then blocks on a threading.Event, which wakes for Ctrl-C and can be given up on, instead of in a
    gloo wait, which ignores signals, closes the connection if given a timeout, and is the only way a gloo
    send or receive ever reports completion (is_completed() stays False until someone waits)."""

    def __init__(self, wait) -> None:
        self._wait = wait
        self._q: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._ended = threading.Event()  # not Thread.join, see PipelineExecutor._connect
        threading.Thread(target=self._run, name="tdpipe-waiter", daemon=True).start()

    def add(self, works: list, keep: object = None) -> _Pending:
        p = _Pending(works, keep)
        self._q.put(p)
        return p

    def stop(self, timeout: float) -> None:
        """Let the thread finish what is queued (fast once the stages are gone: their connections are
        closed) and end; no thread of ours may still be inside gloo when the interpreter exits."""
        self._q.put(None)
        self._ended.wait(timeout)

    def _run(self) -> None:
        try:
            while True:
                p = self._q.get()
                if p is None:
                    return
                for w in p.works:
                    try:
                        self._wait(w)
                    except Exception as e:  # noqa: BLE001 - reported to whoever waits on p
                        p.error = p.error or str(e)
                p.keep = None
                p.done.set()
        finally:
            self._ended.set()


@dataclass
class _InFlight:
    step: StepInput
    pending: _Pending  # the result's receive(s)
    bufs: list[torch.Tensor]  # greedy: [n] ids, or [n, 2] (max, id) per head part; else [n, vocab part] each
    greedy: bool
    submitted: float


class PipelineExecutor(Executor):
    asynchronous = True

    def __init__(self, model_config, model_path: str, dtype: torch.dtype, num_blocks: int, block_size: int,
                 stages: list[StageSpec], max_num_batched_tokens: int, platform: Platform,
                 tensor_parallel_size: int = 1, lm_head_split: float = 0.0, graphs: object | None = None,
                 num_window_blocks: int = 0, cpus: list[int] | None = None) -> None:
        """`cpus`: pin every spawned worker to these cores (None: not pinned). `platform`: the workers' device
        (each worker gets platform.torch_device(its worker index) and the groups' backends from
        pipeline/wire/groups.py's choose_backends). `num_window_blocks`: the
        sliding-window layers' own KV pool (core/window_blocks.py; 0: none)."""
        self.num_stages = len(stages)
        self.stages = stages
        self.layout = lay = Layout(self.num_stages, tensor_parallel_size)
        v = model_config.vocab_size
        # who returns which vocabulary range of the logits (the engine concatenates them in this order):
        # the last stage alone; its T ranks' shards; or the two parts of an lm_head split across stages
        self.head_ranges: dict[int, tuple[int, int]] = {}
        if lm_head_split > 0:
            v0 = min(v - 1, max(1, round(lm_head_split * v)))
            first, last = lay.rank(0), lay.rank(self.num_stages - 1)
            self.head_ranges = {first: (0, v0), last: (v0, v)}
            self.sources = [(first, (0, v0)), (last, (v0, v))]
        elif tensor_parallel_size > 1:
            from tdpipe.model.tensor_parallel import shard_range

            self.sources = [(r, shard_range(v, tensor_parallel_size, t))
                            for t, r in enumerate(lay.stage_ranks(self.num_stages - 1))]
        else:
            self.sources = [(lay.rank(self.num_stages - 1), (0, v))]
        self.vocab = model_config.vocab_size
        self.dtype = dtype
        self.graphs = graphs  # the stages' decode CUDA graphs (worker/cuda_graph.GraphSettings; None: eager)
        self.processes = StageProcesses(lay, [s.threads for s in stages], cpus)
        self.stage_pids: list[int] = []  # from the stages' READY: every rank's, torchrun's too
        self._closing = False
        self._dead = False
        self._start_abandoned = False
        self.t: Transport | None = None
        self._waiter: _Waiter | None = None
        self._connecting: threading.Event | None = None  # set when the group-building thread is done
        self.sender = BlockTableSender()
        self.num_window_blocks = num_window_blocks
        self.local_sender = BlockTableSender()  # the sliding-window layers' tables, when they have a pool
        self._inflight: deque[_InFlight] = deque()
        _live.add(self)
        try:
            self._start(model_config, model_path, dtype, num_blocks, block_size, max_num_batched_tokens,
                        platform)
        except BaseException:
            # Ctrl-C, a stage that failed, anything: no stage outlives a constructor that did not return
            self._start_abandoned = True
            self._dead = True
            self.shutdown()
            raise

    def _start(self, model_config, model_path: str, dtype: torch.dtype, num_blocks: int, block_size: int,
               max_num_batched_tokens: int, platform: Platform) -> None:
        lay = self.layout
        devices = [platform.torch_device(r - 1) for r in lay.worker_ranks()]
        backends = choose_backends(platform.dist_backend, devices, lay)
        self.t = self._connect(self.processes.start())
        self._waiter = _Waiter(self.t.wait)
        dname = "bfloat16" if dtype == torch.bfloat16 else "float32"
        for r in lay.worker_ranks():
            k, t = lay.coords(r)
            s = self.stages[k]
            peer = next((p for p in self.head_ranges if p != r), None) if r in self.head_ranges else None
            init = m.StageInit(k, self.num_stages, s.start_layer, s.end_layer, model_config, model_path, dname,
                               num_blocks, block_size, s.threads, str(devices[r - 1]), max_num_batched_tokens, t,
                               lay.tp, self.head_ranges.get(r), peer, backends.stages, backends.tp,
                               graphs=self.graphs, num_window_blocks=self.num_window_blocks)
            self._send_all([r], m.INIT, init)
        for r in lay.worker_ranks():
            kind, info = self._reply(r)
            if kind != m.READY:
                self._fail(str(info), reported=True)
            self.stage_pids.append(info["pid"])

    def _connect(self, rv: Rendezvous) -> Transport:
        """Build the gloo groups in a helper thread while this thread watches for a dead stage and Ctrl-C:
        a peer that died during the rendezvous would otherwise keep this thread in C++ for minutes."""
        box: dict[str, object] = {}
        done = self._connecting = threading.Event()

        def build() -> None:
            try:
                box["t"] = Transport(rv, self._check_start)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                box["e"] = e
            finally:
                done.set()

        threading.Thread(target=build, name="tdpipe-connect", daemon=True).start()
        # an Event, not Thread.join: a join cut short by Ctrl-C marks the thread finished in Python 3.11
        # (it releases the thread's own state lock), and a later join would not wait
        while not done.wait(_SLICE):
            if self.processes.failure is not None:
                self._fail()
        if "e" in box:
            if self.processes.failure is not None:
                self._fail()
            self._fail(f"connecting to the stages failed: {box['e']}")
        return box["t"]  # type: ignore[return-value]

    def _check_start(self) -> None:
        """Called between the polls of the group rendezvous: give up once the start is abandoned."""
        if self._start_abandoned or self.processes.failure is not None:
            raise RuntimeError("the pipeline's start-up was abandoned")

    @property
    def procs(self) -> list[subprocess.Popen]:
        """The stage processes this engine spawned (none under torchrun)."""
        return self.processes.procs

    @property
    def launcher(self) -> str:
        """How the stages were started: "spawn" or "torchrun"."""
        return self.processes.launcher

    # -- failures ----------------------------------------------------------------------------------------
    def _fail(self, why: str | None = None, reported: bool = False) -> NoReturn:
        """Turn a broken pipe, closed connection or dead stage into one clear error, after cleaning up.
        `reported`: `why` is the stage's own account (it failed to start), better than an exit code."""
        verdict = None if reported else self.processes.verdict(_VERDICT)
        if reported:
            msg = why
        elif verdict is not None:
            msg = verdict
        else:
            stage_says = self.processes.reported()
            msg = (f"the pipeline broke: {stage_says}" if stage_says else why
                   or "the pipeline broke (a stage on another node died or is unreachable)")
        self._dead = True
        self.shutdown()
        raise PipelineError(msg)

    def _abandon(self) -> None:
        """Interrupted where the pipeline cannot be brought back (Ctrl-C while draining it, or in the middle
        of sending a step): stop the stages; every later call raises "the pipeline was shut down"."""
        self._dead = True
        self.shutdown()

    # -- messaging ---------------------------------------------------------------------------------------
    def _send_all(self, ranks: list[int], kind: int, obj: object) -> list[_Pending]:
        packed = self.t.pack(kind, obj)
        out = []
        try:
            for r in ranks:
                out.append(self._waiter.add(self.t.isend_packed(self.t.ctrl, packed, r), keep=packed))
        except RuntimeError as e:
            self._fail(f"sending to the stages failed: {e}")
        return out

    def _await(self, p: _Pending, what: str) -> None:
        """Wait for the waiter thread to finish `p`, in slices: a dead stage or Ctrl-C ends the wait."""
        while not p.done.wait(_SLICE):
            if self.processes.failure is not None:
                self._fail()
            if self._dead:
                raise PipelineError("the pipeline was shut down")
        if p.error is not None:
            self._fail(f"{what}: {p.error}")

    def _reply(self, rank: int) -> tuple[int, object]:
        what = f"{self.layout.name(rank)} stopped answering"

        def wait(work) -> None:
            self._await(self._waiter.add([work]), what)

        try:
            return self.t.recv_obj(self.t.reply, rank, wait=wait)
        except PipelineError:
            raise
        except RuntimeError as e:
            self._fail(f"{what}: {e}")

    def release(self, seq_ids: list[int]) -> None:
        self.sender.release(seq_ids)
        self.local_sender.forget(seq_ids)

    # -- Executor ----------------------------------------------------------------------------------------
    def submit(self, step: StepInput) -> None:
        if self._dead:
            raise PipelineError(self.processes.failure or "the pipeline was shut down")
        greedy = bool(step.greedy_rows) and all(step.greedy_rows)
        n = step.logit_rows()
        if not greedy:
            srcs = [(r, torch.empty(n, b - a, dtype=self.dtype)) for r, (a, b) in self.sources]
        elif self.head_ranges:  # each part's (max, id) per row
            srcs = [(r, torch.empty(n, 2, dtype=torch.float64)) for r, _ in self.sources]
        else:  # ids: the last stage's, or its tp rank 0's for the group
            srcs = [(self.sources[0][0], torch.empty(n, dtype=torch.int64))]
        bufs = [b for _, b in srcs]
        # from the deltas on, all or nothing: the sender's record of what the stages hold, the posted
        # receive and the messages must agree
        with deferred_sigint():
            try:
                deltas = self.sender.deltas(step.seq_ids, step.kv_epochs, step.block_tables)
                msg = m.StepMessage(step.batch_id, step.token_ids, step.query_lens, step.seq_lens,
                                    step.seq_ids, deltas, self.sender.take_freed(), step.is_prefill, greedy,
                                    step.shape(), time.time(), step.block_copies or None,
                                    step.all_logits if any(step.all_logits) else None,
                                    temperatures=step.temperatures or None, stage_seed=step.stage_seed)
                msg.kv_import, msg.kv_export = step.kv_import or None, step.kv_export or None
                if step.local_block_tables:
                    msg.local_deltas = self.local_sender.deltas(step.seq_ids, step.kv_epochs,
                                                                step.local_block_tables)
                try:
                    works = [self.t.irecv(b, r, tensor_tag(step.batch_id)) for r, b in srcs]
                except RuntimeError as e:
                    self._fail(f"posting the result receive failed: {e}")
                self._inflight.append(_InFlight(step, self._waiter.add(works, keep=bufs), bufs, greedy,
                                                time.time()))
                lay = self.layout
                self._send_all(lay.stage_ranks(0), m.STEP, msg)  # the first stage needs the token ids
                if self.num_stages > 1:
                    msg.token_ids = []
                    self._send_all([r for r in lay.worker_ranks() if not lay.is_first(r)], m.STEP, msg)
            except PipelineError:
                raise
            except BaseException:
                self._abandon()
                raise

    def ready(self) -> bool:
        """collect() would not wait: the oldest micro-batch's result is in (or the pipeline failed)."""
        return (not self._inflight or self._inflight[0].pending.done.is_set() or self._dead
                or self.processes.failure is not None)

    def collect(self) -> StepResult:
        """The oldest micro-batch's result. A KeyboardInterrupt while waiting leaves it in flight (see
        drain()); a dead stage raises PipelineError."""
        if self._dead:
            raise PipelineError(self.processes.failure or "the pipeline was shut down")
        f = self._inflight[0]
        self._await(f.pending, "waiting for the last stage failed")
        self._inflight.popleft()
        done = time.time()
        res = StepResult(f.step.batch_id, timings={"submit": f.submitted, "done": done})
        if f.greedy and len(f.bufs) > 1:  # parts of a split head: the best (max, id); ties to the lower id
            pairs = torch.stack(f.bufs, dim=1)  # [n, parts, 2]
            best = pairs[:, :, 0].argmax(dim=1)
            res.token_ids = pairs[torch.arange(len(best)), best, 1].to(torch.int64).tolist()
        elif f.greedy:
            res.token_ids = f.bufs[0].tolist()
        else:
            logits = f.bufs[0] if len(f.bufs) == 1 else torch.cat(f.bufs, dim=1)
            res.logits = host_logits(logits, f.step)
        return res

    def drain(self) -> int:
        """Wait for every micro-batch still in flight and discard its result, so the pipeline is empty and
        the next submit() starts clean; returns how many were dropped. For the engine after an exception
        (a KeyboardInterrupt, say) escaped between submit() and collect(): the stages finish those batches
        and keep their KV (the engine frees those blocks itself), and the block tables stay in sync, since
        every delta sent was applied; finished sequences still go through release(). The engine must forget
        its own record of those batches too. A KeyboardInterrupt during the drain gives up: the stages are
        stopped and every later call raises PipelineError("the pipeline was shut down")."""
        if self._dead:
            self._inflight.clear()
            raise PipelineError(self.processes.failure or "the pipeline was shut down")
        dropped = 0
        try:
            while self._inflight:
                self._await(self._inflight[0].pending, "waiting for the last stage failed")
                self._inflight.popleft()
                dropped += 1
        except KeyboardInterrupt:
            self._inflight.clear()
            self._abandon()
            raise
        except PipelineError:
            self._inflight.clear()
            raise
        return dropped

    def trace_events(self) -> list[list[dict]]:
        """Collect every stage's trace events since the last call (absolute time.time() stamps); a stage of
        T ranks speaks through its tp rank 0 (its events carry the all-reduce time)."""
        if self._dead:
            return [[] for _ in self.stages]
        out = []
        with deferred_sigint():  # a reply left half-received would answer the next call
            try:
                self._send_all(self.layout.leaders(), m.TRACE, None)
                for r in self.layout.leaders():
                    kind, events = self._reply(r)
                    out.append(events if kind == m.TRACE_DATA else [])
            except PipelineError:
                raise
            except BaseException:
                self._abandon()
                raise
        return out

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Every worker (all P x T ranks) runs `method` of its ModelRunner between steps; their results in
        rank order. A worker whose call raised answers with the error's text: raised here as RuntimeError."""
        if self._dead:
            raise PipelineError(self.processes.failure or "the pipeline was shut down")
        out: list = []
        errors: list[str] = []
        ranks = self.layout.worker_ranks()
        with deferred_sigint():  # a reply left half-received would answer the next call
            try:
                self._send_all(ranks, m.RPC, (method, args))
                for r in ranks:
                    kind, (ok, value) = self._reply(r)
                    if kind != m.RPC_DATA:
                        raise PipelineError(f"{self.layout.name(r)} answered {kind} to {method!r}")
                    out.append(value)
                    if not ok:
                        errors.append(f"{self.layout.name(r)}: {value}")
            except PipelineError:
                raise
            except BaseException:
                self._abandon()
                raise
        if errors:
            raise RuntimeError(f"{method} failed on " + "; ".join(errors))
        return out

    def shutdown(self) -> None:
        """STOP the stages (they finish what is in flight first) and wait for them; kill what is left after
        a few seconds, or at once if the pipeline is dead. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self.processes.stopping()
        try:
            if not self._dead and self.t is not None and self._waiter is not None:
                try:
                    pending = self._send_all(self.layout.worker_ranks(), m.STOP, None)
                    deadline = time.monotonic() + _STOP_GRACE
                    for p in pending:
                        p.done.wait(max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - shutting down anyway
                    pass
                self.processes.wait(_STOP_GRACE)
        finally:
            self._dead = True
            self.processes.kill()
            # a helper thread left inside gloo's C++ at interpreter exit aborts the process ("terminate
            # called without an active exception"): with the stages gone both leave within moments
            if self._waiter is not None:
                self._waiter.stop(_JOIN)
            if self._connecting is not None:
                self._connecting.wait(_JOIN)


@atexit.register
def _shutdown_live() -> None:
    """At interpreter exit, stop the pipelines nobody shut down: the stages get their STOP (and finish what
    is in flight) instead of noticing a dead engine, and no helper thread is left inside gloo."""
    for ex in list(_live):
        try:
            ex.shutdown()
        except BaseException:  # noqa: BLE001 - exiting anyway
            pass


__all__ = ["PipelineExecutor", "PipelineError", "StageSpec"]
