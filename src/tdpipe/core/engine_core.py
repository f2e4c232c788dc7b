"""The engine core in its own process (gLLM §3.3: the frontend is decoupled from the scheduler).

It owns the LLMEngine (scheduler, page table, sampler, and the pipeline stages under its executor) and talks
to the frontend (core/async_llm.py) over two ZeroMQ sockets: requests and aborts in, per-step deltas (token
ids only) and a stats snapshot out. Its loop: take every message waiting, run one engine step if anything is
unfinished, send what the step produced. Idle, it blocks on the socket (no spinning) and sends stats once a
second, so the frontend always knows the state without a round trip.

Messages are pickled tuples over ipc:// sockets in a private (0700) directory: both ends are the same user's
processes, started together.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tdpipe")

# frontend -> core
ADD, ABORT, SHUTDOWN = "add", "abort", "shutdown"
# (UPDATE, call id, checkpoint folder, in-flight mode): core/weight_sync.py, once the engine is idle ("finish")
# or right after pausing it ("recompute")
UPDATE = "update_weights"
# What an online weight update does with the requests in flight (AsyncLLM.update_weights_from_disk, the
# server's route): "finish": they complete on the old weights while new ones wait, then the update;
# "recompute": the micro-batches in flight complete, every running request is preempted (LLMEngine.pause)
# and recomputed, prompt and outputs so far, on the new weights. (Offline, LLM.update_weights runs between
# generate() calls: nothing is in flight.)
IN_FLIGHT_MODES = ("finish", "recompute")
# core -> frontend
READY, OUT, REJECTED, DEAD = "ready", "out", "rejected", "dead"
UPDATED = "updated"  # (UPDATED, call id, new weight version or None, error text or None)

# the cores this engine core and its stages run on (data parallelism: core/data_parallel.py), set before
# torch starts its threads; comma-separated core ids
CPUS_ENV = "TDPIPE_ENGINE_CPUS"
IDLE_STATS_S = 1.0  # stats refresh while nothing runs
BUSY_WINDOW_S = 5.0  # stage busy ratio: measured over this window (one stage round trip per window, pp > 1)


@dataclass
class CoreInfo:
    """What the frontend needs to validate requests without asking the core."""

    model_path: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    num_blocks: int
    pp: int
    default_sampling: dict[str, Any]  # the model's sampling defaults (sampling/defaults.py)
    eos_token_ids: list[int] = field(default_factory=list)  # the ids that end an answer (beam search reads them)


def engine_stats(engine: Any, busy: list[float]) -> dict[str, Any]:
    sched, bm = engine.scheduler, engine.block_manager
    bms = sched.block_managers()  # one page table, or one per disaggregated instance: blocks summed over them
    stats = {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
             "num_requests": len(engine.requests), "kv_usage": bm.usage(),
             "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
             "num_preemptions": sched.num_preemptions, "prompt_tokens": engine.stats.prompt_tokens,
             "generation_tokens": engine.stats.output_tokens, "stage_busy": list(busy),
             "prefix_cache_queries": bm.prefix_cache_queries, "prefix_cache_hits": bm.prefix_cache_hits,
             "prefix_cache_hit_rate": bm.prefix_cache_hit_rate, "weight_version": engine.weight_version}
    if len(bms) > 1:
        total, free = sum(b.num_blocks for b in bms), sum(b.num_free_blocks for b in bms)
        queries, hits = sum(b.prefix_cache_queries for b in bms), sum(b.prefix_cache_hits for b in bms)
        stats |= {"kv_usage": 1 - free / total, "num_blocks": total, "num_free_blocks": free,
                  "prefix_cache_queries": queries, "prefix_cache_hits": hits,
                  "prefix_cache_hit_rate": hits / queries if queries else 0.0}
    return stats


class BusyMeter:
    """Per stage, the fraction of the last window it spent computing (1 - bubble ratio), from the stages'
    trace events. Collecting them costs one round trip at pp > 1, so it happens once a window."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.busy = [0.0] * engine.pp
        self.since = time.time()

    def maybe_update(self, running: bool) -> None:
        now = time.time()
        if now - self.since < BUSY_WINDOW_S:
            return
        events = self.engine.collect_stage_events()
        span = now - self.since
        for k, ev in enumerate(events):
            busy = sum(max(0.0, min(e["end"], now) - max(e["start"], self.since)) for e in ev)
            self.busy[k] = min(1.0, busy / span) if running or busy else 0.0
        self.since = now


def run_engine_core(config: Any, in_addr: str, out_addr: str, parent_pid: int) -> None:
    """Process entry point. Exits when told to, when the frontend process is gone, or on SIGTERM."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's: it drains, then stops us
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(out_addr)

    def send(*msg: Any) -> None:
        push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    engine = None
    try:
        from tdpipe.core.engine import LLMEngine

        engine = LLMEngine(config)
        from tdpipe.frozen_heap import freeze_heap

        freeze_heap()  # the model's objects out of the collector's full passes (pauses in steps)
        sched = engine.scheduler.config
        send(READY, CoreInfo(engine.model_path, sched.max_model_len, sched.max_num_seqs,
                             engine.model_config.vocab_size, engine.block_manager.num_blocks, engine.pp,
                             engine.default_sampling, sorted(engine.eos_token_ids)))
        _loop(engine, pull, send, parent_pid, stop)
    except Exception as e:  # noqa: BLE001 - one line to the frontend; every open request gets it
        reason = " ".join(str(e).split()) or type(e).__name__
        if os.environ.get("TDPIPE_DEBUG"):
            traceback.print_exc()
        try:
            send(DEAD, f"engine core failed: {reason}")
        except Exception:  # noqa: BLE001
            pass
        raise SystemExit(1) from None
    finally:
        if engine is not None:
            engine.shutdown()  # stops the pipeline stages
        push.close()
        pull.close(linger=0)
        ctx.term()
        if os.getppid() != parent_pid:  # the frontend was killed: nobody else removes the sockets' folder
            import shutil

            shutil.rmtree(os.path.dirname(in_addr.removeprefix("ipc://")), ignore_errors=True)


def _loop(engine: Any, pull: Any, send: Any, parent_pid: int, stop: dict) -> None:
    import zmq

    meter = BusyMeter(engine)
    last_stats = 0.0
    # a weight update ("finish") waits for the requests in flight to finish on the old weights; requests that
    # arrive meanwhile are held here and added once the new weights are in. "recompute" pauses the engine
    # (LLMEngine.pause) and updates at once; the preempted requests recompute on the new weights
    update: tuple[int, str, str] | None = None
    held: list[tuple] = []

    def add(msg: tuple) -> None:
        _, rid, ids, params, text = msg
        try:
            engine.add_request(rid, text if text is not None else ids, params, prompt_token_ids=ids)
        except ValueError as e:
            send(REJECTED, rid, str(e))
        except Exception:  # noqa: BLE001 - one bad request never takes the core down
            log.exception("engine core: request %r refused by an unexpected error", rid)
            send(REJECTED, rid, "the engine could not add this request (an internal error; see the server log)")

    while not stop["now"]:
        if os.getppid() != parent_pid:
            log.warning("engine core: the frontend process is gone; stopping")
            return
        busy = engine.has_unfinished()
        timeout = 0 if busy else int(IDLE_STATS_S * 1000)
        changed = False
        while pull.poll(timeout, zmq.POLLIN):
            changed = True
            msg = pickle.loads(pull.recv())
            if msg[0] == SHUTDOWN:
                return
            if msg[0] == ADD:
                (held.append if update is not None and update[2] == "finish" else add)(msg)
            elif msg[0] == ABORT:
                if msg[2] != "stop":  # a held request leaves the queue without ever reaching the engine
                    held = [h for h in held if h[1] not in msg[1]]
                # "stop": (request id, sample index) pairs a stop string ended; else request ids
                (engine.abort_samples if msg[2] == "stop" else engine.abort_request)(msg[1], reason=msg[2])
            elif msg[0] == UPDATE:
                if update is not None:
                    send(UPDATED, msg[1], None, "another weight update is already waiting")
                else:
                    update = (msg[1], msg[2], msg[3])
            timeout = 0
        if update is not None and update[2] == "recompute" and engine.has_unfinished():
            paused = engine.pause()  # the micro-batches in flight complete: their tokens go out first
            if paused:
                send(OUT, paused, engine_stats(engine, meter.busy))
        if update is not None and (update[2] == "recompute" or not engine.has_unfinished()):
            from tdpipe.core.weight_sync import update_weights

            try:
                send(UPDATED, update[0], update_weights(engine, update[1]), None)
            except Exception as e:  # noqa: BLE001 - a bad folder is the caller's error, not the core's death
                send(UPDATED, update[0], None, " ".join(str(e).split()) or type(e).__name__)
            update, pending = None, held
            held = []
            for m in pending:
                add(m)
            changed = True
        deltas = engine.step() if engine.has_unfinished() else []
        meter.maybe_update(bool(deltas))
        now = time.time()
        if deltas or changed or now - last_stats >= IDLE_STATS_S:
            send(OUT, deltas, engine_stats(engine, meter.busy))
            last_stats = now


if __name__ == "__main__":  # started by AsyncLLM: python -m tdpipe.core.engine_core CONFIG IN OUT PARENT_PID
    import sys

    if os.environ.get(CPUS_ENV):  # before torch: its thread count (config.default_threads) follows the mask
        os.sched_setaffinity(0, {int(c) for c in os.environ[CPUS_ENV].split(",")})

    with open(sys.argv[1], "rb") as f:
        cfg = pickle.load(f)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s tdpipe-core: %(message)s")
    import torch  # noqa: F401 - what the stages forked now need not import again (pipeline/prefork.py)

    from tdpipe.pipeline import prefork

    prefork.reserve(prefork.stages_for(cfg.parallel))  # before zmq's threads and the engine's work
    from tdpipe.core.engine_core import run_engine_core as run  # the module's classes, not __main__'s: they
    try:
        run(cfg, sys.argv[2], sys.argv[3], int(sys.argv[4]))  # are unpickled by the frontend
    finally:
        from tdpipe.frozen_heap import freeze_heap

        freeze_heap()  # before the interpreter's teardown
