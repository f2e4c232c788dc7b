"""Request state as the scheduler and engine see it; no torch here."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet prefilled, or preempted (recompute) and waiting again
    RUNNING = "running"  # KV in the cache, decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. Its KV lives in the blocks of `block_table`; `num_computed_tokens` of its tokens have KV."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # tdpipe.sampling.SamplingParams (kept untyped: no import cycle, no torch)
    prompt: str | None = None
    max_tokens: int = 16  # resolved limit: sampling_params.max_tokens or what max_model_len leaves
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "error"
    stop_reason: int | str | None = None
    output_text: str = ""
    predicted_output_len: int | None = None  # TD-Pipe §3.3 (filled by a predictor)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    in_flight: bool = False  # part of a micro-batch that has not returned yet
    # parallel sampling (n > 1 / best_of): which of its request's samples this is; sample 0 is the sequence
    # the request started as. `group` (core/sample_group.SampleGroup, kept untyped: no import cycle) owns the
    # request's samples: forks, aborts; None for a sequence outside an engine (a scheduler test)
    sample_index: int = 0
    group: Any = None
    cumulative_logprob: float = 0.0  # of the sampled tokens (logprobs or best_of requests)
    prompt_logprobs: list | None = None  # per prompt position, filled chunk by chunk (prompt_logprobs=k)
    # the page table: bumped when the block table is rebuilt (preemption) or an entry is replaced
    # (copy-on-write), so the stages replace their copy instead of extending it (pipeline/wire/block_sync.py)
    table_epoch: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (or shared by fork) at admission
    block_hashes: list[bytes] = field(default_factory=list)  # memo: chained hashes of its full token blocks
    probed_blocks: int = 0  # memo of BlockManager.probe_cached_tokens while it waits
    local_block_table: list[int] = field(default_factory=list)  # sliding-window layers' blocks (core/window_blocks.py)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logits(self) -> bool:
        """prompt_logprobs asked and not all computed yet: every prompt position's logits are needed, so
        the prompt is prefilled whole (no prefix-cache hit)."""
        k = getattr(self.sampling_params, "prompt_logprobs", None)
        return k is not None and self.sample_index == 0 and (self.prompt_logprobs is None or len(self.prompt_logprobs) < self.num_prompt_tokens)

    @property
    def num_samples_pending(self) -> int:
        """Sequences this one stands for in max_num_seqs: itself and the samples it will fork."""
        return 1 + (self.group.num_unforked(self) if self.group is not None else 0)

    def reset_for_recompute(self) -> None:
        """Recompute preemption: drop the KV; the prompt and the outputs so far are prefilled again later."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.table_epoch += 1  # stages drop their copy of the old block table
