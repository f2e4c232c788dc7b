"""Decode steps as captured graphs (CUDA graphs; vLLM's --cuda-graph-sizes idea): one graph per batch size.

A pure-decode step launches hundreds of small kernels whose launch time, not their work, bounds a small
batch on a GPU. So the stage's layer slice is captured once per size in `sizes`, reading static input
buffers (token ids or hidden states, positions, KV slots, block tables padded to the widest table, sequence
lengths) and writing a static output. A decode batch of B rows runs the graph of the next captured size:
padded rows have KV slot -1 (nothing is written to the cache), sequence length 1 and block 0 (attention
reads one in-bounds token), and their outputs are dropped. Prefills and batches above the largest size run
eagerly (ModelRunner).

Input preparation overlaps the previous step (SiPipe §5.2): the stage's prep thread packs step i+1's inputs
on the host while the device runs step i. It packs into one of `versions` host staging buffers, taken from
a `StagingRing`: a version is handed out again only after the step that used it copied it to the device
(its fence completed), so a staging buffer an in-flight copy reads is never overwritten. The copy into the
device's static buffers is issued by the compute thread just before the replay, in stream order, so one set
of device buffers and one graph per size suffice.

Capture goes through a backend: `CudaGraphBackend` (torch.cuda.CUDAGraph) on CUDA, `FakeGraphBackend` on
CPU, which records the callable and replays it on the static buffers, so everything but the capture itself
(padding, static buffers, the ring, fallbacks, outputs equal to eager) is tested on CPU.
The CUDA backend captured and replayed decode graphs on an H200 (scripts/gpu_check.sh; docs/gpu.md).
"""
from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tdpipe.model.llama import AttentionMetadata
from tdpipe.step_input import StepInput

MAX_DEFAULT_SIZE = 256  # the default sizes stop here (vLLM's v0 default), capped by max_num_seqs
DEFAULT_VERSIONS = 2  # host staging buffers: one being prepared while the other's step runs (SiPipe §5.2)


def default_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to min(max_num_seqs, 256), and that cap itself: a batch is padded
    by at most 7 rows."""
    cap = max(1, min(max_num_seqs, MAX_DEFAULT_SIZE))
    sizes = [s for s in [1, 2, 4, *range(8, cap + 1, 8)] if s <= cap]
    return sorted(set(sizes) | {cap})


def capture_sizes(requested: list[int] | None, max_num_seqs: int) -> list[int]:
    """The sizes to capture: `requested` (--cuda-graph-sizes), those above max_num_seqs lowered to it (no
    batch is larger), or the defaults."""
    if not requested:
        return default_sizes(max_num_seqs)
    return sorted({min(s, max_num_seqs) for s in requested if s >= 1})


@dataclass(frozen=True)
class GraphSettings:
    """What a ModelRunner needs to capture its decode graphs: the sizes and the longest sequence (which sets
    the width of the static block tables)."""

    sizes: tuple[int, ...]
    max_model_len: int
    versions: int = DEFAULT_VERSIONS


def graph_settings(supports_graphs: bool, enforce_eager: bool, requested: list[int] | None, max_num_seqs: int,
                   max_model_len: int) -> GraphSettings | None:
    """None (run eagerly) on a platform without graphs or with --enforce-eager; else the settings."""
    if not supports_graphs or enforce_eager:
        return None
    return GraphSettings(tuple(capture_sizes(requested, max_num_seqs)), max_model_len)


# -- capture backends ----------------------------------------------------------------------------------------
@dataclass
class Captured:
    """A captured graph: replay() reruns it on the static inputs; `output` is the static tensor it writes."""

    replay: Callable[[], None]
    output: torch.Tensor


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured: ...

    def fence(self) -> object | None:
        """A marker after the work issued so far (None: that work is already done)."""

    def wait(self, fence: object) -> None:
        """Block the host until the work before `fence` is done."""


class FakeGraphBackend:
    """CPU stand-in: `capture` runs fn once (its result becomes the static output) and keeps it; `replay`
    runs it again on whatever the static buffers hold and copies the result into the static output, which
    is what a replayed graph does. Counts captures and replays for the tests."""

    def __init__(self) -> None:
        self.captures: list[int] = []  # rows of each captured graph's output, in capture order
        self.replays: list[int] = []  # rows of each replayed graph

    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured:
        out = fn()
        rows = int(out.shape[0])
        self.captures.append(rows)

        def replay() -> None:
            self.replays.append(rows)
            out.copy_(fn())

        return Captured(replay, out)

    def fence(self) -> object | None:
        return None  # CPU copies are synchronous: done when issued

    def wait(self, fence: object) -> None:
        fence.wait()  # type: ignore[attr-defined]  (a test's fence)


class CudaGraphBackend:
    """torch.cuda.CUDAGraph: a few eager warm-up runs on a side stream (lazy initialisation, Triton's
    compilation), then the capture; every graph shares one memory pool. Ran on an H200."""

    WARMUP = 2

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return Captured(graph.replay, out)

    def fence(self) -> object | None:
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, fence: object) -> None:
        fence.synchronize()  # type: ignore[attr-defined]  (Event.wait() would make a stream wait, not the host)


# -- versioned host staging ----------------------------------------------------------------------------------
class StagingRing:
    """`versions` host staging buffers handed out in turn (0, 1, 0, 1, ...). acquire() blocks while every
    version is held, then waits for the fence of the version's last copy to the device; release() hands a
    version back with the fence of the copy that reads it. So a version is never rewritten while a step
    that reads it is in flight."""

    def __init__(self, versions: int, wait: Callable[[object], None]) -> None:
        if versions < 1:
            raise ValueError(f"versions must be >= 1, got {versions}")
        self.versions = versions
        self._free: deque[int] = deque(range(versions))
        self._fences: list[object | None] = [None] * versions
        self._cond = threading.Condition()
        self._wait = wait
        self.held: set[int] = set()  # versions handed out and not yet released

    def acquire(self, timeout: float | None = None) -> int:
        """The next free version (TimeoutError after `timeout` seconds with none free)."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout):
                raise TimeoutError(f"no staging buffer free in {timeout} s (held: {sorted(self.held)})")
            v = self._free.popleft()
            self.held.add(v)
            fence, self._fences[v] = self._fences[v], None
        if fence is not None:
            self._wait(fence)
        return v

    def release(self, version: int, fence: object | None) -> None:
        with self._cond:
            if version not in self.held:
                raise RuntimeError(f"staging version {version} released but not held")
            self.held.discard(version)
            self._fences[version] = fence
            self._free.append(version)
            self._cond.notify()


@dataclass
class _Buffers:
    """One set of decode inputs for up to `rows` sequences (host staging or the device's static set)."""

    ids: torch.Tensor  # int64 [N] (first stage)
    positions: torch.Tensor  # int64 [N]
    slots: torch.Tensor  # int64 [N]
    block_tables: torch.Tensor  # int32 [N, max_blocks]
    seq_lens: torch.Tensor  # int32 [N]

    @classmethod
    def make(cls, rows: int, max_blocks: int, device: torch.device, pin: bool = False) -> "_Buffers":
        def z(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            t = torch.zeros(*shape, dtype=dtype, device=device)
            return t.pin_memory() if pin else t

        b = cls(z(rows, dtype=torch.int64), z(rows, dtype=torch.int64), z(rows, dtype=torch.int64),
                z(rows, max_blocks, dtype=torch.int32), z(rows, dtype=torch.int32))
        b.slots.fill_(-1)  # a fresh buffer describes padding only: nothing is written to the cache
        b.seq_lens.fill_(1)
        return b

    def parts(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.positions, self.slots, self.block_tables, self.seq_lens


@dataclass
class GraphInput:
    """A decode step staged for replay: its staging version, the captured size and the real rows."""

    version: int
    size: int
    rows: int
    step: StepInput = field(repr=False)


class DecodeGraphs:
    """The decode graphs of one stage: `forward(x, meta)` is its layer slice (token ids [T] on the first
    stage, hidden states [T, H] elsewhere -> hidden states [T, H]). capture() records one graph per size;
    stage() (prep thread) and run() (compute thread) then execute decode steps through them."""

    def __init__(self, forward: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor], *, first: bool,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, block_size: int,
                 settings: GraphSettings, backend: GraphBackend, copy_out: bool = False) -> None:
        """`copy_out`: run() returns a copy of the graph's output rows (a stage whose output outlives the
        next replay: hidden states handed to a sender thread); else a view of the static output."""
        self.forward = forward
        self.first = first
        self.block_size = block_size
        self.sizes = sorted(settings.sizes)
        self.max_size = self.sizes[-1]
        self.max_blocks = max(1, math.ceil(settings.max_model_len / block_size))
        self.backend = backend
        self.copy_out = copy_out
        self.device = device
        pin = device.type == "cuda"
        self.static = _Buffers.make(self.max_size, self.max_blocks, device)
        self.hidden = None if first else torch.zeros(self.max_size, hidden_size, dtype=dtype, device=device)
        self.staging = [_Buffers.make(self.max_size, self.max_blocks, torch.device("cpu"), pin)
                        for _ in range(settings.versions)]
        self.ring = StagingRing(settings.versions, backend.wait)
        cu = torch.arange(self.max_size + 1, dtype=torch.int32, device=device)  # decode: one query row each
        s = self.static
        self.metas = {n: AttentionMetadata(positions=s.positions[:n], slot_mapping=s.slots[:n],
                                           block_tables=s.block_tables[:n], cu_seqlens_q=cu[:n + 1],
                                           seq_lens=s.seq_lens[:n], fresh=False, cu_seqlens_list=list(range(n + 1)))
                      for n in self.sizes}
        self.graphs: dict[int, Captured] = {}

    # -- set-up ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, largest first (the smaller ones then reuse its pool's memory). The static
        buffers hold padding only, so the capture (and a backend's warm-up runs) write nothing to the cache."""
        for n in reversed(self.sizes):
            x = self.static.ids[:n] if self.first else self.hidden[:n]
            meta = self.metas[n]
            self.graphs[n] = self.backend.capture(lambda x=x, meta=meta: self.forward(x, meta))

    # -- which steps ---------------------------------------------------------------------------------------
    def size_for(self, step: StepInput) -> int | None:
        """The captured size this step runs at, or None: run it eagerly (a prefill, prompt logprobs, more
        rows than the largest size, a block table wider than the static one)."""
        n = len(step.query_lens)
        if (step.is_prefill or n == 0 or n > self.max_size or any(q != 1 for q in step.query_lens)
                or step.fresh or any(step.all_logits)
                or max(len(t) for t in step.block_tables) > self.max_blocks):
            return None
        return next(s for s in self.sizes if s >= n)

    # -- prep thread ---------------------------------------------------------------------------------------
    def stage(self, step: StepInput, size: int) -> GraphInput:
        """Pack the step into a free staging version, padded to `size` rows (blocks while every version is
        in flight)."""
        v = self.ring.acquire()
        try:
            self._pack(self.staging[v], step, size)
        except BaseException:
            self.ring.release(v, None)
            raise
        return GraphInput(v, size, len(step.query_lens), step)

    def _pack(self, h: _Buffers, step: StepInput, size: int) -> None:
        n, bs = len(step.query_lens), self.block_size
        width = max(len(t) for t in step.block_tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in step.block_tables], dtype=torch.int32)
        seq = torch.tensor(step.seq_lens, dtype=torch.int64)
        pos = seq - 1
        # columns past a row's length keep earlier values: valid block ids attention never reads
        h.block_tables[:n, :width] = table
        h.block_tables[n:size, 0] = 0  # padding: the dummy block 0, read for one token
        h.positions[:n] = pos
        h.positions[n:size] = 0
        h.slots[:n] = table[torch.arange(n), pos // bs].to(torch.int64) * bs + pos % bs
        h.slots[n:size] = -1  # padding writes nothing
        h.seq_lens[:n] = seq.to(torch.int32)
        h.seq_lens[n:size] = 1
        if self.first:
            h.ids[:n] = torch.tensor(step.token_ids, dtype=torch.int64)
            h.ids[n:size] = 0

    # -- compute thread ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, g: GraphInput, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the staged inputs (and `hidden`, on a stage after the first) into the static buffers, hand
        the staging version back, replay; the first `g.rows` rows of the output."""
        n = g.size
        host = self.staging[g.version]
        nb = self.device.type != "cpu"
        for dst, src in zip(self.static.parts(), host.parts()):
            if src is host.ids and not self.first:
                continue
            dst[:n].copy_(src[:n], non_blocking=nb)
        self.ring.release(g.version, self.backend.fence())
        if not self.first:
            self.hidden[:g.rows].copy_(hidden)
        graph = self.graphs[n]
        graph.replay()
        out = graph.output[:g.rows]
        return out.clone() if self.copy_out else out


__all__ = ["Captured", "CudaGraphBackend", "DecodeGraphs", "FakeGraphBackend", "GraphBackend", "GraphInput",
           "GraphSettings", "StagingRing", "capture_sizes", "default_sizes", "graph_settings"]
