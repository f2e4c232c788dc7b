"""What one micro-batch's step is, as every executor, stage and model runner receives it (docs/design.md,
data flow step 2): plain lists, no tensors, no scheduler types. It sits below the engine, the executors and
the workers alike; the scheduler's Batch turns itself into one (core/batch.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepInput:
    """The metadata message sent to stages.

    A stage derives positions and KV slots from seq_lens and block_tables itself, so it can prepare its
    inputs before activations arrive (gLLM §3.3 preemptive metadata; SiPipe §5.3).
    """

    batch_id: int
    token_ids: list[int]  # new tokens, flattened in sequence order
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # tokens with KV after this step (cached prefix + new)
    block_tables: list[list[int]]
    is_prefill: bool
    greedy_rows: list[bool] = field(default_factory=list)  # per sampled row: may the last stage argmax?
    seq_ids: list[int] = field(default_factory=list)  # for block-table deltas (pipeline/wire/block_sync.py)
    kv_epochs: list[int] = field(default_factory=list)  # per sequence: its table epoch (block_sync)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the step runs
    # per sequence: logits for every new token (prompt_logprobs) instead of the last one only; [] = none
    all_logits: list[bool] = field(default_factory=list)
    # stage sampling (--sampling-device, sampling/stage_rows.py): per sampled row, the temperature the last
    # stage samples a greedy_rows row at (0.0: argmax); [] = argmax every such row. stage_seed: the step's draws
    temperatures: list[float] = field(default_factory=list)
    stage_seed: int = 0
    # per sequence: the sliding-window layers' block table (core/window_blocks.py); [] = no such pool
    local_block_tables: list[list[int]] = field(default_factory=list)
    # prefill/decode disaggregation (worker/kv_transfer.py): (staging slot, block) pairs copied into the KV cache
    # before the step runs, and (block, staging slot) pairs copied out of it after the step computed
    kv_import: list[tuple[int, int]] = field(default_factory=list)
    kv_export: list[tuple[int, int]] = field(default_factory=list)
    instance: int = 0  # disaggregation: the instance (executor/pd.py numbering) that runs this step

    def logit_rows(self) -> int:
        """Rows of the logits the last stage returns: one per sequence, or one per new token of a sequence
        in `all_logits`."""
        if not any(self.all_logits):
            return len(self.query_lens)
        return sum(q if a else 1 for q, a in zip(self.query_lens, self.all_logits))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids else sum(self.query_lens)

    def shape(self) -> tuple[int, int]:
        """(prefill tokens, decoding sequences): the batch's shape in traces. A row is a decode when it
        has one new token and a cached prefix."""
        prefill = decode = 0
        for q, s in zip(self.query_lens, self.seq_lens):
            if q == 1 and s > 1:
                decode += 1
            else:
                prefill += q
        return prefill, decode

    @property
    def fresh(self) -> bool:
        """No sequence has a cached prefix, so attention needs only the new tokens."""
        return all(q == s for q, s in zip(self.query_lens, self.seq_lens))


__all__ = ["StepInput"]
