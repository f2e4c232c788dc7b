"""A pipeline stage worker process (TD-Pipe §3.2 execution plane).

Three threads, so a stage never waits on its own bookkeeping:
  prep    receives the engine's metadata, rebuilds block tables from deltas, prepares the input tensors
          and posts the receive for the activations with the shape already known (gLLM §3.3); it runs
          one micro-batch ahead of compute, into one of two alternating receive buffers (SiPipe §5.2);
  main    waits for the activations, runs the layer slice, hands the output to the sender;
  sender  sends hidden states to the next stage, or logits / argmax ids to the engine (SiPipe §5.1).
Every micro-batch leaves a trace event: compute start/end, time waiting for input, send time, shape.

Run as `python -m tdpipe.worker.stage --master HOST:PORT --rank R --world-size W` (the engine spawns
these), or by torchrun through tdpipe.executor.pipeline.run_stage_if_worker.
"""
from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time
import traceback

import torch

from tdpipe.core.batch import StepInput
from tdpipe.core.block_sync import BlockTableMirror
from tdpipe.executor import messages as m
from tdpipe.executor.transport import Rendezvous, Transport, join_rendezvous, tensor_tag

ENGINE = 0


class StageWorker:
    def __init__(self, transport: Transport, init: m.StageInit) -> None:
        from tdpipe.worker.model_runner import ModelRunner

        self.t = transport
        self.init = init
        self.first = init.stage == 0
        self.last = init.stage == init.num_stages - 1
        torch.set_num_threads(init.threads)
        dtype = torch.bfloat16 if init.dtype == "bfloat16" else torch.float32
        self.runner = ModelRunner(init.model_config, init.model_path, dtype, init.num_blocks, init.block_size,
                                  init.start_layer, init.end_layer, device=init.device)
        self.dtype = dtype
        self.hidden = init.model_config.hidden_size
        # two alternating receive buffers: prep fills one while compute reads the other (SiPipe §5.2)
        cap = max(1, init.max_num_batched_tokens) * self.hidden
        self.buffers = [torch.empty(cap, dtype=dtype, device=init.device) for _ in range(2)]
        self.buffer_free = threading.Semaphore(2)
        self.mirror = BlockTableMirror()
        self.ready: queue.Queue = queue.Queue(maxsize=2)
        self.outbox: queue.Queue = queue.Queue()
        self.events: list[dict] = []

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
                                 msg.is_prefill, seq_ids=msg.seq_ids)
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
                    work = self.t.irecv(buf, self.init.stage, tensor_tag(msg.batch_id))  # rank = stage + 1
                self.ready.put((m.STEP, (msg, inp, buf, work, t_meta, time.time())))
        except BaseException:  # noqa: BLE001
            _fatal(f"stage {self.init.stage} (input preparation)")

    # -- sender thread ------------------------------------------------------------------------------------
    def send_loop(self) -> None:
        try:
            while True:
                item = self.outbox.get()
                if item is None:
                    return
                tensor, dst, tag, event = item
                t0 = time.time()
                self.t.isend(tensor, dst, tag).wait()
                event["send"] = time.time() - t0
                self.outbox.task_done()
        except BaseException:  # noqa: BLE001
            _fatal(f"stage {self.init.stage} (send)")

    # -- main thread --------------------------------------------------------------------------------------
    def run(self) -> None:
        prep = threading.Thread(target=self.prep_loop, name="tdpipe-prep", daemon=True)
        sender = threading.Thread(target=self.send_loop, name="tdpipe-send", daemon=True)
        prep.start()
        sender.start()
        dst = ENGINE if self.last else self.init.stage + 2
        while True:
            t_wait = time.time()
            kind, payload = self.ready.get()
            if kind == m.STOP:
                self.outbox.put(None)
                sender.join()
                return
            if kind == m.TRACE:
                self.outbox.join()  # every earlier send finished, so every event has its send time
                events, self.events = self.events, []
                self.t.send_obj(self.t.reply, m.TRACE_DATA, events, ENGINE)
                continue
            msg, inp, buf, work, t_meta, t_prepared = payload
            if work is not None:
                work.wait()
            start = time.time()
            out = self.runner.execute(inp, buf)
            if buf is not None:
                self.buffer_free.release()
            if self.last:
                out = self._result(out, msg.greedy)
            end = time.time()
            event = {"batch_id": msg.batch_id, "start": start, "end": end, "wait": start - t_wait, "send": 0.0,
                     "meta_latency": t_meta - msg.sent_at, "prep": t_prepared - t_meta,
                     "prefill_tokens": msg.shape[0], "decode_seqs": msg.shape[1], "context_tokens": sum(msg.seq_lens)}
            self.events.append(event)
            self.outbox.put((out, dst, tensor_tag(msg.batch_id), event))

    def _result(self, logits: torch.Tensor, greedy: bool) -> torch.Tensor:
        """Sampling happens on the engine, off this stage (SiPipe §5.1): greedy batches need only ids."""
        from tdpipe.model import cpu_ops as ops

        if greedy:
            return ops.argmax(logits).to(torch.int64).cpu()
        return logits.contiguous().cpu()


def _fatal(where: str) -> None:
    """A stage that fails exits at once: the engine sees the exit (or the closed connection) and fails the
    run within seconds, rather than waiting on a stage that will never answer."""
    print(f"tdpipe: {where} failed:", file=sys.stderr)
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)


def serve(rv: Rendezvous, device: str = "cpu") -> None:
    """Join the pipeline as a stage: receive StageInit, build, acknowledge, run until STOP."""
    from tdpipe.malloc import pin_mmap_threshold

    pin_mmap_threshold()  # activations of varying size every step (see tdpipe/malloc.py)
    t = Transport(rv)
    kind, init = t.recv_obj(t.ctrl, ENGINE)
    if kind != m.INIT:
        raise RuntimeError(f"stage rank {rv.rank}: expected INIT from the engine, got message kind {kind}")
    try:
        worker = StageWorker(t, init)
    except BaseException as e:
        t.send_obj(t.reply, m.FAILED, f"stage {init.stage} failed to start: {e!r}", ENGINE)
        raise
    t.send_obj(t.reply, m.READY, {"pid": os.getpid(), "stage": init.stage}, ENGINE)
    worker.run()


def _die_with_parent() -> None:
    """A spawned stage must not outlive the engine (no orphans), even if the engine is SIGKILLed."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="tdpipe pipeline stage worker (started by the engine)")
    p.add_argument("--master", required=True, help="HOST:PORT of the engine's rendezvous store")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--parent", type=int, default=None, help="engine pid: exit if it is gone")
    a = p.parse_args(argv)
    _die_with_parent()
    if a.parent is not None and os.getppid() != a.parent:
        return 1  # the engine died before we set PDEATHSIG
    host, port = a.master.rsplit(":", 1)
    try:
        serve(join_rendezvous(host, int(port), a.rank, a.world_size))
    except BaseException:  # noqa: BLE001
        _fatal(f"stage rank {a.rank}")
    os._exit(0)  # skip interpreter teardown with gloo threads alive


if __name__ == "__main__":
    sys.exit(main())
