"""What the scheduler hands the executor: a micro-batch, which turns itself into the step message every
stage receives (tdpipe/step_input.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tdpipe.sequence import Sequence, SequenceStatus
from tdpipe.step_input import StepInput


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
    # prefill/decode disaggregation (core/scheduler/pd.py): the instance that runs the batch and the KV
    # blocks it moves through the staging area (StepInput.kv_import / kv_export)
    instance: int = 0
    kv_import: list[tuple[int, int]] = field(default_factory=list)
    kv_export: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def sampled_rows(self) -> list[int]:
        """Rows that get a token when this batch returns: their new tokens reach the last known token (a
        decode, or the last chunk of a prefill). An earlier prefill chunk samples nothing, and neither does a
        request aborted while the batch was in flight."""
        finished = SequenceStatus.FINISHED  # num_tokens and is_finished inlined: once per row, twice a step
        return [i for i, (s, n) in enumerate(zip(self.seqs, self.num_new_tokens))
                if s.num_computed_tokens + n == len(s.prompt_token_ids) + len(s.output_token_ids)
                and s.status is not finished]

    def step_input(self) -> StepInput:
        """The message the executor sends for this batch (tdpipe/step_input.py): the new tokens, the
        lengths and block tables, no scheduler types."""
        toks: list[int] = []
        seq_lens: list[int] = []
        for seq, n in zip(self.seqs, self.num_new_tokens):
            start = seq.num_computed_tokens
            if n == 1 and start == seq.num_tokens - 1:
                toks.append(seq.last_token_id)
            else:
                toks.extend(seq.all_token_ids[start:start + n])
            seq_lens.append(start + n)
        return StepInput(
            batch_id=self.batch_id,
            token_ids=toks,
            query_lens=list(self.num_new_tokens),
            seq_lens=seq_lens,
            block_tables=[s.block_table for s in self.seqs],
            is_prefill=self.is_prefill,
            seq_ids=[s.seq_id for s in self.seqs],
            kv_epochs=[s.table_epoch for s in self.seqs],
            block_copies=list(self.block_copies),
            # a sliding-window pool (core/window_blocks.py) gives every scheduled sequence a local table
            local_block_tables=([s.local_block_table for s in self.seqs]
                                if self.seqs and self.seqs[0].local_block_table else []),
            kv_import=list(self.kv_import), kv_export=list(self.kv_export), instance=self.instance,
        )


__all__ = ["Batch", "StepInput"]  # StepInput lives in tdpipe/step_input.py
