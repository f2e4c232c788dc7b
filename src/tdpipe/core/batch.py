"""What the scheduler hands the executor: a micro-batch and the small metadata a stage needs to run it."""
from __future__ import annotations

from dataclasses import dataclass, field

from tdpipe.sequence import Sequence


@dataclass
class Batch:
    """One micro-batch. Prefill and decode are never mixed under `separate` (is_prefill says which)."""

    batch_id: int
    seqs: list[Sequence]
    num_new_tokens: list[int]  # query tokens per sequence this step
    is_prefill: bool
    # copy-on-write: (src, dst) KV blocks every stage copies before running this batch (BlockManager.prepare_append)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    all_logits: list[bool] = field(default_factory=list)  # as sent (StepInput.all_logits): the result's layout

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def sampled_rows(self) -> list[int]:
        """Rows that get a token when this batch returns: their new tokens reach the last known token (a
        decode, or the last chunk of a prefill). An earlier prefill chunk samples nothing, and neither does a
        request aborted while the batch was in flight."""
        return [i for i, (s, n) in enumerate(zip(self.seqs, self.num_new_tokens))
                if s.num_computed_tokens + n == s.num_tokens and not s.is_finished]


@dataclass
class StepInput:
    """The metadata message sent to stages (ARCHITECTURE.md, data flow step 2): plain lists, no tensors.

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

    @classmethod
    def from_batch(cls, batch: Batch) -> "StepInput":
        toks: list[int] = []
        seq_lens: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            if n == 1 and start == seq.num_tokens - 1:
                toks.append(seq.last_token_id)
            else:
                toks.extend(seq.all_token_ids[start:start + n])
            seq_lens.append(start + n)
        return cls(
            batch_id=batch.batch_id,
            token_ids=toks,
            query_lens=list(batch.num_new_tokens),
            seq_lens=seq_lens,
            block_tables=[s.block_table for s in batch.seqs],
            is_prefill=batch.is_prefill,
            seq_ids=[s.seq_id for s in batch.seqs],
            kv_epochs=[s.table_epoch for s in batch.seqs],
            block_copies=list(batch.block_copies),
        )
