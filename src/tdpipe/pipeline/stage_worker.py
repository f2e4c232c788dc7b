"""The stage side of the data path (TD-Pipe §3.2 execution plane): one rank of a stage's tensor-parallel
group (T = 1: the whole stage); pipeline/stage.py is the process around it.

Three threads, so a stage never waits on its own bookkeeping:
  prep    receives the engine's metadata, rebuilds block tables from deltas, prepares the input tensors
          and posts the receive for the activations with the shape already known (gLLM §3.3); it runs
          one micro-batch ahead of compute, into one of two alternating receive buffers (SiPipe §5.2); a
          decode step run as a CUDA graph is packed into one of the graph runner's versioned staging
          buffers, never one an in-flight step still reads (worker/cuda_graph.py);
  main    waits for the activations, runs the layer slice, hands the output to the sender;
  sender  sends hidden states to the next stage, or logits / token ids to the engine (SiPipe §5.1; ids
          when the stage picks every row: greedy, or with --sampling-device stage plain temperature).
Every micro-batch leaves a trace event: compute start/end, time waiting for input, send time, shape, and
with T > 1 the time spent in the tensor-parallel all-reduces (TD-Pipe Fig. 6's split of TP time).
Peers come from the layout (tdpipe/pipeline/wire/layout.py): activations from the same tp rank of the previous
stage, to the same tp rank of the next; the last stage's ranks send the engine their logits shards, or tp
rank 0 the greedy ids the group agreed on.

The lm_head split across stages (--lm-head-split, T = 1): the last stage normalises the sampled rows,
sends them to the first stage and computes its vocabulary rows [V0, V); the first stage computes rows
[0, V0) when they arrive (a head waiter thread queues that work behind the micro-batch it is computing),
and both send the engine their part: logits, or for greedy batches each row's (max, id) pair. With the head
balanced across the two ends a decode step and a prefill step both split evenly (the policies issue's
decode imbalance: the last stage carried the whole head).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from tdpipe.executor.base import MAX_STAGE_EVENTS
from tdpipe.pipeline.wire import messages as m
from tdpipe.pipeline.wire.block_sync import BlockTableMirror
from tdpipe.pipeline.wire.layout import ENGINE, Layout
from tdpipe.pipeline.wire.transport import Transport, head_tag, tensor_tag
from tdpipe.step_input import StepInput

HEAD = 20  # a ready-queue item: normalised rows arrived for this (first) stage's part of a split lm_head


class StageWorker:
    """One rank's threads: prep, sender, the split head's waiter where it has one, and compute (run())."""

    def __init__(self, transport: Transport, init: m.StageInit, fatal: Callable[[str], None]) -> None:
        """`fatal(where)`: what a helper thread calls when it fails (pipeline/stage.py reports why and ends
        the process: a stage never limps on with a thread gone)."""
        from tdpipe.worker.model_runner import ModelRunner

        self.fatal = fatal
        self.t = transport
        self.init = init
        self.layout = Layout(init.num_stages, init.tp_size)
        self.rank = self.layout.rank(init.stage, init.tp_rank)
        if self.rank != transport.rank:
            raise RuntimeError(f"rank {transport.rank} was sent the INIT of rank {self.rank} ({self.layout})")
        self.name = self.layout.name(self.rank)
        self.first = init.stage == 0
        self.last = init.stage == init.num_stages - 1
        self.prev = self.layout.prev_peer(self.rank)
        torch.set_num_threads(init.threads)
        dtype = torch.bfloat16 if init.dtype == "bfloat16" else torch.float32
        from tdpipe.model.tensor_parallel import SINGLE, GlooTPGroup

        self.tp = SINGLE
        if init.tp_size > 1:
            pg = transport.stage_group(init.stage, init.tp_rank, init.tp_size)
            self.tp = GlooTPGroup(pg, init.tp_rank, init.tp_size)
        self.runner = ModelRunner(init.model_config, init.model_path, dtype, init.num_blocks, init.block_size,
                                  init.start_layer, init.end_layer, device=init.device, tp=self.tp,
                                  head_range=init.head_range, graphs=init.graphs,
                                  num_window_blocks=init.num_window_blocks)
        self.head_peer = init.head_peer  # the lm_head split: the last stage's rank (first) / the first's (last)
        self.dtype = dtype
        self.device = init.device
        self.hidden = init.model_config.hidden_size
        # two alternating receive buffers: prep fills one while compute reads the other (SiPipe §5.2)
        cap = max(1, init.max_num_batched_tokens) * self.hidden
        self.buffers = [torch.empty(cap, dtype=dtype, device=init.device) for _ in range(2)]
        self.buffer_free = threading.Semaphore(2)
        self.mirror = BlockTableMirror()
        self.local_mirror = BlockTableMirror()  # the sliding-window layers' tables (core/window_blocks.py)
        # bounded by the engine's micro-batches in flight (P), and by the two receive buffers below
        self.ready: queue.Queue = queue.Queue()
        self.heads: queue.Queue = queue.Queue()  # receives of normalised rows, for the head waiter
        self.outbox: queue.Queue = queue.Queue()
        self.events: deque[dict] = deque(maxlen=MAX_STAGE_EVENTS)  # until the engine asks (bounded)

    # -- prep thread -------------------------------------------------------------------------------------
    def prep_loop(self) -> None:
        n = 0
        try:
            while True:
                kind, msg = self.t.recv_obj(self.t.ctrl, ENGINE)
                t_meta = time.time()
                if kind != m.STEP:
                    self.ready.put((kind, msg))
                    if kind == m.STOP:
                        return
                    continue
                tables = self.mirror.apply(msg.seq_ids, msg.deltas, msg.freed)
                step = StepInput(msg.batch_id, msg.token_ids, msg.query_lens, msg.seq_lens, tables,
                                 msg.is_prefill, seq_ids=msg.seq_ids, block_copies=msg.block_copies or [],
                                 all_logits=msg.all_logits or [], kv_import=msg.kv_import or [],
                                 kv_export=msg.kv_export or [])
                if msg.local_deltas is not None:
                    step.local_block_tables = self.local_mirror.apply(msg.seq_ids, msg.local_deltas, msg.freed)
                inp = self.runner.prepare(step)
                work = buf = None
                if not self.first:
                    numel = step.num_tokens * self.hidden
                    self.buffer_free.acquire()
                    slot = n % 2
                    n += 1
                    if self.buffers[slot].numel() < numel:
                        self.buffers[slot] = torch.empty(numel, dtype=self.dtype, device=self.buffers[slot].device)
                    buf = self.buffers[slot][:numel].view(step.num_tokens, self.hidden)
                    work = self.t.irecv(buf, self.prev, tensor_tag(msg.batch_id))
                self.ready.put((m.STEP, (msg, inp, buf, work, t_meta, time.time())))
                if self.first and self.head_peer is not None and not self.last:
                    rows = torch.empty(step.logit_rows(), self.hidden, dtype=self.dtype, device=self.device)
                    self.heads.put((msg, rows, self.t.irecv(rows, self.head_peer, head_tag(msg.batch_id))))
        except BaseException:  # noqa: BLE001
            self.fatal(f"{self.name} (input preparation)")

    # -- head waiter thread (first stage of a split lm_head) -----------------------------------------------
    def head_loop(self) -> None:
        """Wait for each micro-batch's normalised rows in order and queue the head work behind whatever the
        main thread is computing (a gloo receive reports completion only to a wait)."""
        try:
            while True:
                msg, rows, work = self.heads.get()
                self.t.wait(work)
                self.ready.put((HEAD, (msg, rows, time.time())))
        except BaseException:  # noqa: BLE001
            self.fatal(f"{self.name} (lm_head rows)")

    # -- sender thread ------------------------------------------------------------------------------------
    def send_loop(self) -> None:
        try:
            while True:
                item = self.outbox.get()
                if item is None:
                    return
                tensor, dst, tag, event = item
                t0 = time.time()
                self.t.wait(self.t.isend(tensor, dst, tag))
                event["send"] = time.time() - t0
                self.outbox.task_done()
        except BaseException:  # noqa: BLE001
            self.fatal(f"{self.name} (send)")

    # -- main thread --------------------------------------------------------------------------------------
    def run(self) -> None:
        prep = threading.Thread(target=self.prep_loop, name="tdpipe-prep", daemon=True)
        sender = threading.Thread(target=self.send_loop, name="tdpipe-send", daemon=True)
        prep.start()
        sender.start()
        if self.first and self.head_peer is not None and not self.last:
            threading.Thread(target=self.head_loop, name="tdpipe-head", daemon=True).start()
        split_last = self.last and self.head_peer is not None
        dst = self.layout.next_peer(self.rank)
        while True:
            t_wait = time.time()
            kind, payload = self.ready.get()
            if kind == m.STOP:
                self.outbox.put(None)
                sender.join()
                return
            if kind == m.TRACE:
                self.outbox.join()  # every earlier send finished, so every event has its send time
                events, self.events = list(self.events), deque(maxlen=MAX_STAGE_EVENTS)
                self.t.send_obj(self.t.reply, m.TRACE_DATA, events, ENGINE)
                continue
            if kind == m.RPC:
                self.outbox.join()  # every earlier result sent: the call sees the stage between steps
                method, args = payload
                try:
                    reply = (True, getattr(self.runner, method)(*args))
                except Exception as e:  # noqa: BLE001 - the engine raises it, naming this worker
                    reply = (False, f"{type(e).__name__}: {e}")
                self.t.send_obj(self.t.reply, m.RPC_DATA, reply, ENGINE)
                continue
            if kind == HEAD:
                self._head(*payload, t_wait)
                continue
            msg, inp, buf, work, t_meta, t_prepared = payload
            if work is not None:
                self.t.wait(work)
            start = time.time()
            comm0 = self.tp.comm_seconds
            out = self.runner.execute(inp, buf, normed_rows=split_last)
            if buf is not None:
                self.buffer_free.release()
            if split_last:  # the first stage's part of the head starts as soon as the rows reach it
                self.outbox.put((out.contiguous(), self.head_peer, head_tag(msg.batch_id), {}))
                out = self._split_result(self.runner.head(out), msg)
            elif self.last:
                out = self._result(out, msg)
            end = time.time()
            event = {"batch_id": msg.batch_id, "start": start, "end": end, "wait": start - t_wait, "send": 0.0,
                     "meta_latency": t_meta - msg.sent_at, "prep": t_prepared - t_meta,
                     "prefill_tokens": msg.shape[0], "decode_seqs": msg.shape[1], "context_tokens": sum(msg.seq_lens)}
            if self.tp.size > 1:
                event["allreduce"] = self.tp.comm_seconds - comm0  # inside compute: TP's share (Fig. 6)
            self.events.append(event)
            if out is not None:
                self.outbox.put((out, dst, tensor_tag(msg.batch_id), event))

    def _head(self, msg: m.StepMessage, rows: torch.Tensor, arrived: float, t_wait: float) -> None:
        """The first stage's part of a split lm_head for one micro-batch, sent straight to the engine."""
        start = time.time()
        out = self._split_result(self.runner.head(rows), msg)
        event = {"batch_id": msg.batch_id, "start": start, "end": time.time(), "wait": start - t_wait,
                 "send": 0.0, "head": True, "rows_latency": start - arrived, "prefill_tokens": 0,
                 "decode_seqs": 0, "context_tokens": 0}
        self.events.append(event)
        self.outbox.put((out, ENGINE, tensor_tag(msg.batch_id), event))

    def _split_result(self, logits: torch.Tensor, msg: m.StepMessage) -> torch.Tensor:
        """A part of a split lm_head: its logits, or for batches the stage picks each row's (max, id) over
        this part as float64 pairs (ids < 2^53 are exact) for the engine to pick from; temperature rows
        perturbed first, each part with its own noise (sampling/device_sampler.py)."""
        if not msg.greedy:
            return logits.contiguous().cpu()
        from tdpipe.model import cpu_ops as ops

        if msg.temperatures:
            logits = self.runner.sampler.perturb(logits, msg.temperatures, msg.stage_seed, self.rank)
        idx = ops.argmax(logits).to(torch.int64)
        val = logits.gather(1, idx[:, None]).squeeze(1).to(torch.float64)
        return torch.stack([val, (idx + self.runner.model.head_range[0]).to(torch.float64)], dim=1).cpu()

    def _result(self, logits: torch.Tensor, msg: m.StepMessage) -> torch.Tensor | None:
        """Sampling happens on the engine, off this stage (SiPipe §5.1), unless the stage picks every row:
        greedy rows, and with stage sampling plain-temperature rows (sampling/stage_rows.py). Then only ids
        travel, which the group agrees on (every rank takes part, each perturbing its shard with its own
        noise) and tp rank 0 sends; otherwise each rank sends its vocabulary shard of the logits. None:
        nothing for this rank to send."""
        if msg.greedy:
            ids = self.runner.sample(logits, msg.temperatures or [], msg.stage_seed, self.rank)
            return ids.to(torch.int64).cpu() if self.init.tp_rank == 0 else None
        return logits.contiguous().cpu()


__all__ = ["StageWorker"]
