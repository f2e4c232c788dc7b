"""The control plane (TD-Pipe §3.2): schedule -> submit -> collect -> sample + update -> emit.

The engine owns the requests, the page table (BlockManager) and the sampler; an Executor owns the compute.
It keeps up to `executor.num_stages` micro-batches in flight so a pipeline never waits on the engine.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tdpipe.config import EngineConfig, ModelConfig, cpu_supports_bf16, default_threads
from tdpipe.core.batch import Batch, StepInput
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.scheduler import make_scheduler
from tdpipe.executor.base import Executor, StepResult
from tdpipe.model.weights import load_hf_config
from tdpipe.sampling.params import SamplingParams
from tdpipe.sampling.sampler import Sampler, make_generator
from tdpipe.sequence import Sequence, SequenceStatus
from tdpipe.tokenizer import Detokenizer, load_tokenizer

log = logging.getLogger("tdpipe")


def resolve_dtype(name: str) -> torch.dtype:
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name in ("float32", "fp32"):
        return torch.float32
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    started: float = field(default_factory=time.perf_counter)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from tdpipe.model.bundled import resolve_model

        self.config = config
        self.model_path = resolve_model(config.model)
        hf = load_hf_config(self.model_path)
        self.model_config = ModelConfig.from_hf(hf)
        self.tokenizer = load_tokenizer(self.model_path)
        self.detok = Detokenizer(self.tokenizer)
        self.eos_token_ids = self._eos_ids(hf)
        self.dtype = resolve_dtype(config.dtype)
        torch.set_num_threads(config.num_threads or default_threads())

        sched = config.scheduler
        mc = self.model_config
        if sched.max_model_len <= 0:
            sched.max_model_len = mc.max_position_embeddings
        elif sched.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len ({sched.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({mc.max_position_embeddings})")
        cache = config.cache
        dtype_bytes = torch.finfo(self.dtype).bits // 8
        block_bytes = mc.kv_bytes_per_token(dtype_bytes) * cache.block_size
        num_blocks = cache.num_blocks or max(1, cache.budget_bytes() // block_bytes)
        capacity = num_blocks * cache.block_size
        if capacity < sched.max_model_len:
            log.info("KV capacity %d tokens < max_model_len %d: lowering max_model_len", capacity, sched.max_model_len)
            sched.max_model_len = capacity
        # separate never chunks a prefill, so one whole prompt must fit in a batch
        sched.max_num_batched_tokens = max(sched.max_num_batched_tokens, sched.max_model_len)
        self.block_manager = BlockManager(num_blocks, cache.block_size)
        self.scheduler = make_scheduler(sched, self.block_manager)
        self.executor = self._make_executor(num_blocks)
        self.sampler = Sampler()
        self._seq_ids = itertools.count()
        self._generators: dict[int, torch.Generator | None] = {}
        self.stats = EngineStats()
        self.kv_trace: list[tuple[float, float]] = []  # (time, KV usage) for plots
        torch.manual_seed(config.seed)

    def _eos_ids(self, hf: dict[str, Any]) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        try:
            with open(os.path.join(self.model_path, "generation_config.json")) as f:
                e = json.load(f).get("eos_token_id")
            ids.update([e] if isinstance(e, int) else (e or []))
        except (OSError, ValueError):
            pass
        return ids

    def _make_executor(self, num_blocks: int) -> Executor:
        from tdpipe.executor.local import LocalExecutor
        from tdpipe.worker.model_runner import ModelRunner

        runner = ModelRunner(self.model_config, self.model_path, self.dtype, num_blocks, self.config.cache.block_size)
        return LocalExecutor(runner)

    # -- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    prompt_token_ids: list[int] | None = None) -> Sequence:
        """Validate and queue a request. Raises ValueError naming the problem; nothing is queued then."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            else:
                prompt_token_ids = list(prompt)
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        max_len = self.scheduler.config.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {max_len} "
                             "(the prompt must leave room for at least one output token)")
        room = max_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seq = Sequence(next(self._seq_ids), request_id, list(prompt_token_ids), params, prompt=text,
                       max_tokens=max_tokens)
        self._generators[seq.seq_id] = make_generator(params)
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one micro-batch; returns the sequences that finished in it."""
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (KV cache too small?)")
            return []
        step = self._to_step(batch)
        self.executor.submit(step)
        return self._finish(batch, self.executor.collect())

    def _to_step(self, batch: Batch) -> StepInput:
        step = StepInput.from_batch(batch)
        step.greedy_rows = [s.sampling_params.is_greedy and not s.sampling_params.needs_penalties
                            and len(s.output_token_ids) >= s.sampling_params.min_tokens for s in batch.seqs]
        return step

    def _finish(self, batch: Batch, result: StepResult) -> list[Sequence]:
        seqs = batch.seqs
        for seq, n in zip(seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        if result.token_ids is not None:
            tokens = result.token_ids
        else:
            tokens = self._sample(seqs, result.logits)
        now = time.perf_counter()
        finished = []
        for seq, tok in zip(seqs, tokens):
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.output_token_ids.append(tok)
            if self._check_stop(seq, tok):
                seq.status = SequenceStatus.FINISHED
                seq.finish_time = now
                self._generators.pop(seq.seq_id, None)
                finished.append(seq)
        if batch.is_prefill:
            self.stats.prefill_steps += 1
            self.stats.prompt_tokens += batch.num_tokens
        else:
            self.stats.decode_steps += 1
        self.stats.output_tokens += len(seqs)
        self.scheduler.on_result(batch)
        self.kv_trace.append((now, self.block_manager.usage()))
        return finished

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        params = [s.sampling_params for s in seqs]
        eos = sorted(self.eos_token_ids)
        for i, (s, p) in enumerate(zip(seqs, params)):
            if len(s.output_token_ids) < p.min_tokens:  # no stop token before min_tokens
                ban = ([] if p.ignore_eos else eos) + list(p.stop_token_ids or [])
                if ban:
                    logits[i, ban] = float("-inf")
        need_hist = [p.needs_penalties for p in params]
        prompts = [s.prompt_token_ids if h else [] for s, h in zip(seqs, need_hist)]
        outs = [s.output_token_ids if h else [] for s, h in zip(seqs, need_hist)]
        gens = [self._generators.get(s.seq_id) for s in seqs]
        return self.sampler(logits, params, prompts, outs, gens)

    def _check_stop(self, seq: Sequence, tok: int) -> bool:
        p = seq.sampling_params
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                seq.finish_reason = "stop"
                return True
            if p.stop_token_ids and tok in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok
                return True
            if p.stop:
                text, stop, idx = self.detok.find_stop(seq.output_token_ids, seq.output_text, p.stop,
                                                       p.skip_special_tokens)
                seq.output_text = text
                if idx >= 0:
                    end = idx + len(stop) if p.include_stop_str_in_output else idx
                    seq.output_text = text[:end]
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    return True
        if n_out >= seq.max_tokens or seq.num_tokens >= self.scheduler.config.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def final_text(self, seq: Sequence) -> str:
        if isinstance(seq.stop_reason, str):  # stop string: text already cut there
            return seq.output_text
        ids = seq.output_token_ids
        return self.detok.decode(ids, seq.sampling_params.skip_special_tokens)

    def shutdown(self) -> None:
        self.executor.shutdown()
