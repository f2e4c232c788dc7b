"""Messages between the engine (rank 0) and the stage workers: small, pickled, no tensors."""
from __future__ import annotations

from dataclasses import dataclass

from tdpipe.pipeline.wire.block_sync import Delta

# ctrl group, engine -> stages
INIT, STEP, TRACE, STOP, RPC = 1, 2, 3, 4, 5  # RPC: (method of the ModelRunner, args), run between steps
# reply group, stages -> engine
READY, TRACE_DATA, FAILED, RPC_DATA = 10, 11, 12, 13  # RPC_DATA: (ok, the result or the error's text)


@dataclass
class StageInit:
    """What a stage needs to build itself; sent by the engine so torchrun-launched ranks need no flags."""

    stage: int
    num_stages: int
    start_layer: int
    end_layer: int
    model_config: object  # tdpipe.config.ModelConfig
    model_path: str
    dtype: str  # "bfloat16" | "float32"
    num_blocks: int
    block_size: int
    threads: int
    device: str
    max_num_batched_tokens: int  # sizes the two alternating receive buffers (SiPipe §5.2)
    tp_rank: int = 0  # this worker's rank in its stage's tensor-parallel group
    tp_size: int = 1  # T: ranks per stage (tdpipe/pipeline/wire/layout.py)
    # the lm_head split across stages (--lm-head-split): this stage's vocabulary rows of it and the rank at
    # the other end (the first stage receives normalised rows from the last); None: not split
    head_range: tuple[int, int] | None = None
    head_peer: int | None = None
    # the device groups' backends (pipeline/wire/groups.py: choose_backends): worker -> worker activations,
    # and each stage's tensor-parallel group; () means gloo for every stage
    stage_backend: str = "gloo"
    tp_backends: tuple[str, ...] = ()
    graphs: object | None = None  # decode CUDA graphs to capture (worker/cuda_graph.GraphSettings; None: eager)
    num_window_blocks: int = 0  # the sliding-window layers' own KV pool (core/window_blocks.py); 0: none


@dataclass
class StepMessage:
    """One micro-batch's metadata (docs/design.md, data flow step 2). Stages after the first get no
    token ids; every stage gets block-table deltas instead of whole tables (pipeline/wire/block_sync.py)."""

    batch_id: int
    token_ids: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    seq_ids: list[int]
    deltas: list[Delta]
    freed: list[int]
    is_prefill: bool
    greedy: bool  # all rows greedy: the last stage returns argmax ids, not logits (SiPipe §5.1)
    shape: tuple[int, int] = (0, 0)  # (prefill tokens, decode sequences), for the trace
    sent_at: float = 0.0
    block_copies: list[tuple[int, int]] | None = None  # copy-on-write, before the step (every stage)
    all_logits: list[bool] | None = None  # prompt_logprobs rows: logits of every new token (last stage)
    # stage sampling (sampling/stage_rows.py): per row the temperature the last stage samples at when it picks
    # every row (greedy; 0.0: argmax; None: argmax all), and the seed of the step's draws
    temperatures: list[float] | None = None
    stage_seed: int = 0
    local_deltas: list[Delta] | None = None  # the sliding-window layers' table deltas (None: no such pool)
    # prefill/decode disaggregation (worker/kv_transfer.py): staging (slot, block) pairs to import before the
    # step, (block, slot) pairs to export after it
    kv_import: list[tuple[int, int]] | None = None
    kv_export: list[tuple[int, int]] | None = None
