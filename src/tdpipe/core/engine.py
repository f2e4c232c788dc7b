"""The control plane (TD-Pipe §3.2): schedule -> submit -> collect -> sample -> scheduler.update_from_output.

The engine owns the requests (one SampleGroup each: core/sample_group.py), the page table (BlockManager)
and the sampler; an Executor owns the compute. It keeps up to `executor.num_stages` micro-batches in flight
so a pipeline never waits on the engine. It works in token ids: each step returns per-request deltas
(core/delta.py); text and stop strings are the frontend's (core/output_processor.py). Everything built once
before the first step (model, KV sizing, partition, executor, profile, scheduler) is core/engine_builder.py's.
"""
from __future__ import annotations

import logging
import os
import platform
import time
from collections import deque
from typing import Any, Callable

import torch

from tdpipe.config import EngineConfig
from tdpipe.core.batch import Batch, StepInput
from tdpipe.core.delta import RequestDelta, TokenLogprobs
from tdpipe.core.engine_builder import EngineParts, build_engine_parts
from tdpipe.core.sample_group import SampleGroup, SampleId, apply_draws
from tdpipe.core.validation import (RequestError, RequestLimits, check_bad_words, check_floats, check_logit_bias,
                                   check_prompt, check_stops, truncated)
from tdpipe.executor.base import Executor, StepResult
from tdpipe.sampling.bad_words import bad_words_token_ids
from tdpipe.sampling.grammar import GrammarManager, parse_grammar
from tdpipe.sampling.metadata import SamplingMetadata
from tdpipe.sampling.params import SamplingParams
from tdpipe.sampling.prompt_logprobs import split_prompt_logits
from tdpipe.sampling.sampler import Sampler
from tdpipe.sampling.stage_rows import samples_on_stage, stage_rows, stage_seed, stage_tokens
from tdpipe.sequence import Sequence, SequenceStatus
from tdpipe.tokenizer import require_unicode

log = logging.getLogger("tdpipe")

ExecutorFactory = Callable[[Any], Executor]


NO_TOKENIZER = "this engine has no tokenizer (skip_tokenizer_init, a simulated or an in-memory model)"


class LLMEngine:
    """Runs the loop over ready parts. `LLMEngine(config)` builds them first (core/engine_builder.py);
    `executor_factory`: see there (the simulator's executor)."""

    def __init__(self, parts: EngineParts | EngineConfig, executor_factory: ExecutorFactory | None = None) -> None:
        if isinstance(parts, EngineConfig):
            parts = build_engine_parts(parts, executor_factory)
        self.config = parts.config
        self.model_path, self.model_config, self.tokenizer = parts.model_path, parts.model_config, parts.tokenizer
        self.eos_token_ids, self.dtype = parts.eos_token_ids, parts.dtype
        self.pp = self.config.parallel.pipeline_parallel_size
        self.tp = self.config.parallel.tensor_parallel_size
        self.block_manager, self.scheduler, self.executor = parts.block_manager, parts.scheduler, parts.executor
        self.partition, self.lm_head_split, self.stage_threads = parts.partition, parts.lm_head_split, parts.stage_threads
        self.predictor, self.history, self.stats = parts.predictor, parts.history, parts.stats
        self._batched = parts.batched_predictor
        self._unpredicted: deque[Sequence] = self._batched.pending if self._batched is not None else deque()
        for p in (self.predictor, getattr(self.predictor, "fallback", None)):
            if hasattr(p, "text_of"):
                p.text_of = self._prompt_text
        self._seq_ids = parts.seq_ids
        self.default_sampling = parts.default_sampling  # the model's sampling defaults (sampling/defaults.py)
        self.clock: Callable[[], float] = self.executor.now
        self.sampler = Sampler()
        self.grammars = GrammarManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.stage_sampling = samples_on_stage(self.config.sampling_device, parts.platform.name)
        self._inflight: deque[Batch] = deque()
        self.requests: dict[str, SampleGroup] = {}  # unfinished requests by id (abort_request looks them up)
        self._closed = False
        self.weight_version = 0  # bumped by every update_weights (core/weight_sync.py)
        self.sleeping = 0  # the level of sleep(); 0: awake
        self.asleep: set[str] = set()  # the parts not yet woken (core/weight_sync.py WAKE_TAGS)
        self.tracing = self.config.collect_trace
        self.trace_start = self.clock()
        self.kv_trace: deque[tuple[float, float]] = self._bounded()  # (time, KV usage): TD-Pipe Fig. 12
        self.engine_trace: deque[dict] = self._bounded()  # per micro-batch: submit and result times
        self._stage_events: list[deque[dict]] = [self._bounded() for _ in range(self.pp)]

    @classmethod
    def from_config(cls, config: EngineConfig, executor_factory: ExecutorFactory | None = None,
                    hf_config: dict[str, Any] | None = None, seed: int = 0) -> "LLMEngine":
        """`hf_config`: a model config dict, run with random weights drawn in memory from `seed` (tests,
        benchmarks of shapes): no folder, no tokenizer."""
        return cls(build_engine_parts(config, executor_factory, hf_config, seed))

    # -- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    prompt_token_ids: list[int] | None = None) -> Sequence:
        """Validate and queue a request. Raises ValueError naming the problem; nothing is queued then."""
        self._check_open()
        if self.sleeping:
            raise RuntimeError("the engine is asleep (sleep() freed its KV cache): call wake_up() first")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        check_stops(params.stop, params.stop_token_ids)  # what SamplingParams alone cannot bound: stop caps,
        check_floats(params)  # floats in float32, the range the sampler uses them at
        params.revalidate()  # fields set after the object was built: checked, and their derived state follows
        if params.structured_outputs is not None:
            parse_grammar(params.structured_outputs)  # a schema xgrammar refuses fails here, not in a step
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            prompt_token_ids = self.encode_prompt(prompt) if isinstance(prompt, str) else prompt
        max_len = self.scheduler.config.max_model_len
        prompt_token_ids = truncated(list(prompt_token_ids), params, max_len)
        # the frontend's prompt check (one token at least, ids in the vocabulary, room for one output token)
        check_prompt(prompt_token_ids, self.request_limits)
        check_logit_bias(params, self.model_config.vocab_size)
        room = max_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if self.tokenizer is None and params.stop:  # they would never match: no output processor can decode
            raise ValueError(f"stop strings are found in the text: {NO_TOKENIZER}")
        if params.bad_words:
            self._resolve_bad_words(params)
        if params.num_samples > self.scheduler.config.max_num_seqs:
            raise ValueError(f"{'best_of' if params.best_of else 'n'} is {params.num_samples}, more samples than "
                             f"max_num_seqs ({self.scheduler.config.max_num_seqs}) lets run at once")
        seq = Sequence(next(self._seq_ids), request_id, prompt_token_ids, params, prompt=text,
                       max_tokens=max_tokens, arrival_time=self.clock())
        group = SampleGroup(seq)  # n / best_of: forked from seq once its prompt is prefilled
        if params.structured_outputs is not None:  # compiled on a worker thread while the prompt prefills
            group.grammar = self.grammars.compile(params.structured_outputs)
        self.scheduler.add(seq)  # may refuse what its scheduling does not support (disaggregation: n > 1)
        self.requests[request_id] = group
        if self._batched is not None:
            self._batched.add(seq)
        return seq

    @property
    def request_limits(self) -> RequestLimits:
        """The limits a prompt is checked against (core/validation.py), as the frontends see them."""
        return RequestLimits(self.scheduler.config.max_model_len, self.scheduler.config.max_num_seqs,
                             self.model_config.vocab_size)

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's token ids, with the tokenizer's special tokens (a ValueError without one)."""
        if self.tokenizer is None:
            raise ValueError(f"{NO_TOKENIZER}: give prompt_token_ids")
        return self.tokenizer.encode(require_unicode(text, "prompt"), add_special_tokens=True)

    def _resolve_bad_words(self, params: SamplingParams) -> None:
        """bad_words as token sequences of this model's tokenizer (sampling/bad_words.py), each id checked."""
        check_bad_words(params.bad_words)
        if self.tokenizer is None:
            raise ValueError(f"bad_words are tokenized: {NO_TOKENIZER}")
        seqs = bad_words_token_ids(params.bad_words,
                                   lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        vocab = self.model_config.vocab_size
        bad = sorted({t for ids in seqs for t in ids if t >= vocab})
        if bad:
            raise RequestError(f"bad_words tokenize to ids outside the model's vocabulary of {vocab}: {bad[:8]}",
                               "bad_words")
        params.bad_words_token_ids = seqs

    def _prompt_text(self, seq: Sequence) -> str:
        if seq.prompt is None:
            seq.prompt = self.tokenizer.decode(seq.prompt_token_ids)
        return seq.prompt

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine was shut down; create a new LLM")

    # -- abort ---------------------------------------------------------------------------------------
    def abort_request(self, request_ids: str | list[str], reason: str = "abort") -> list[Sequence]:
        """Finish these requests (every sample) now with finish_reason `reason`; unknown or finished ids are
        ignored. reason="stop": the frontend found a stop string; the request counts as finished normally
        (the predictor learns its length, --record-history records it).

        A waiting or idle running sequence leaves its queue and frees its KV blocks at once. One inside a
        micro-batch still in flight keeps its blocks until that batch returns (the stages may still write
        them); its result is then dropped and the blocks freed by the scheduler as for any finished request.
        Returns the sequences aborted."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if not all(isinstance(r, str) for r in ids):
            raise TypeError("abort_request takes request ids (str); one sample of a request: abort_samples")
        return self._abort([(rid, None) for rid in ids], reason)

    def abort_samples(self, samples: list[SampleId], reason: str = "stop") -> list[Sequence]:
        """Finish single samples of n > 1 requests, each named (request id, sample index), as abort_request
        does whole requests. Before the samples are forked (the prompt still prefilling), sample k > 0 is
        then never forked, and sample 0, the sequence that carries the shared prompt, takes the whole
        request with it."""
        return self._abort([(rid, int(k)) for rid, k in samples], reason)

    def _abort(self, targets: list[tuple[str, int | None]], reason: str) -> list[Sequence]:
        done = []
        now = self.clock()
        for rid, index in targets:
            group = self.requests.get(rid)
            if group is None:
                continue
            for seq in group.abort(index):
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason, seq.finish_time = reason, now
                if reason != "abort":
                    self._observe(seq)
                if not seq.in_flight:
                    self.scheduler.abort(seq)
                    self.executor.release([seq.seq_id])
                done.append(seq)
            if group.finished:
                self.requests.pop(rid, None)
        return done

    def abort_all(self) -> list[Sequence]:
        """After an exception escaped step() (a KeyboardInterrupt, say) the engine may hold micro-batches in
        flight and requests in any state: drop the in-flight results, abort every request, and check that
        the page table is whole again, so the next call starts from a clean engine."""
        self._check_open()
        try:
            self.executor.drain()
        except Exception as e:  # noqa: BLE001 - a dead pipeline: later calls raise its error
            log.debug("drain after interrupt failed: %s", e)
        for batch in self._inflight:
            for s in batch.seqs:
                s.in_flight = False
        self._inflight.clear()
        seqs = self.abort_request(list(self.requests))
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):  # not in self.requests (a
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"  # step interrupted midway)
            self.scheduler.abort(seq)
            seqs.append(seq)
        self.scheduler.reset_idle()
        for bm in self.scheduler.block_managers():  # one page table, or one per disaggregated instance
            if bm.num_free_blocks != bm.num_blocks:
                # only an interrupt inside an allocation can get here: nothing runs, so every block is free
                log.warning("abort: %d KV blocks were still referenced with no request left; freeing them",
                            bm.num_blocks - bm.num_free_blocks)
                bm.reset()
        return seqs

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Keep the pipeline full (up to pipeline_depth micro-batches in flight) and complete the oldest one.
        With stage processes (executor.asynchronous) the pipeline is filled again before returning: the
        caller's work on the deltas (detokenising, stop strings, sending outputs) then runs while the stages
        compute instead of between a result and the next micro-batch (SiPipe §4: CPU work off the critical
        path). Returns a delta for every request that got a token (aborted requests get none:
        abort_request returned them)."""
        self._check_open()
        self._fill()
        if not self._inflight:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (KV cache too small?)")
            return []
        deltas = self._complete_oldest()
        if self.executor.asynchronous:
            self._fill()
        return deltas

    def _fill(self) -> None:
        """Schedule and submit micro-batches until pipeline_depth are in flight (--pipeline-depth, default
        pp). Output lengths are predicted in batches while the stages compute; before the first batch first,
        since Algorithm 1 needs them to admit anything."""
        if self._unpredicted and not self._inflight:
            self._batched.predict_pending()
        depth = self.scheduler.config.pipeline_depth
        while len(self._inflight) < depth and (batch := self.scheduler.schedule()) is not None:
            self._submit(batch)
        if self._unpredicted and self._inflight:
            self._batched.predict_pending()

    def _complete_oldest(self) -> list[RequestDelta]:
        """Collect the oldest micro-batch in flight, sample its rows, and hand the tokens to the scheduler."""
        result = self.executor.collect()
        # after collect: an interrupted wait leaves the batch in flight. Results come oldest first, except from
        # a disaggregated executor's instances (executor/pd.py), each oldest first
        k = next(i for i, b in enumerate(self._inflight) if b.batch_id == result.batch_id)
        batch = self._inflight[k]
        del self._inflight[k]
        aborted = [s.seq_id for s in batch.seqs if s.is_finished]  # while in flight: result dropped
        deltas, finished = self._process(batch, result)
        if self.tracing:
            entry = next((e for e in reversed(self.engine_trace) if e["batch_id"] == batch.batch_id), None)
            if entry is not None:
                entry["done"] = self.clock()
        if finished or aborted:
            self.executor.release([s.seq_id for s in finished] + aborted)
        return deltas

    def pause(self) -> list[RequestDelta]:
        """Stop computing without losing a request (a weight update that recomputes, core/weight_sync.py):
        the micro-batches in flight complete (their tokens are returned), then every running sequence is
        preempted by recompute: its KV freed, its prompt and outputs so far prefilled again when it is next
        scheduled. Unfinished requests stay queued; nothing holds a KV block or is in flight afterwards."""
        self._check_open()
        deltas: list[RequestDelta] = []
        while self._inflight:
            deltas += self._complete_oldest()
        for seq in list(self.scheduler.running):
            self.scheduler.preempt(seq)
        return deltas

    def _submit(self, batch: Batch) -> None:
        if self.tracing:
            now = self.clock()
            self.engine_trace.append({"batch_id": batch.batch_id, "submit": now})
            self.kv_trace.append((now, self.block_manager.usage()))  # blocks are taken at schedule time
        batch.block_copies = self.scheduler.take_block_copies()
        step = batch.step_input()
        step.greedy_rows, step.temperatures = stage_rows(batch.seqs, self.stage_sampling)
        step.stage_seed = stage_seed(step.temperatures)
        if any(s.needs_prompt_logits for s in batch.seqs):
            batch.all_logits = step.all_logits = [s.needs_prompt_logits for s in batch.seqs]
        self.executor.submit(step)
        self._inflight.append(batch)

    def _process(self, batch: Batch, result: StepResult) -> tuple[list[RequestDelta], list[Sequence]]:
        """Sample the batch's sampled rows (and the first tokens of the samples forked now), hand the tokens
        to the scheduler, and turn what changed into deltas."""
        # decode rows: one new token over a cached prefix (the rest is prompt being prefilled)
        n_decode = sum(1 for s, n in zip(batch.seqs, batch.num_new_tokens) if n == 1 and s.num_computed_tokens > 0)
        rows = batch.sampled_rows()  # a prefill chunk short of the prompt's end samples nothing
        seqs = [batch.seqs[i] for i in rows]
        samples = [(s, k) for s in seqs for k in s.group.draws(s)]
        tokens, lps, forks = apply_draws(samples, *self._draw(batch, result, rows, samples), self._seq_ids.__next__)
        finished = self.scheduler.update_from_output(batch, tokens)
        now = self.clock()
        for seq in seqs:
            if seq.first_token_time is None:
                seq.first_token_time = now
        for seq in finished:
            seq.finish_time = now
            self._observe(seq)
        self.stats.count_step(n_decode, len(batch.seqs), batch.num_tokens, len(samples))
        if self.tracing:
            self.kv_trace.append((now, self.block_manager.usage()))
        deltas = []
        for s, t, lp in zip(seqs, tokens, lps):
            deltas.append(self._delta(s, t, lp))
            deltas += [self._delta(child, ct, clp) for child, ct, clp in forks.get(s.seq_id, ())]
        return deltas, finished

    def _draw(self, batch: Batch, result: StepResult, rows: list[int],
              samples: list[tuple[Sequence, int]]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per (sequence, sample index): the last stage's argmax for a greedy-only batch (the
        forks of a greedy request are all the same answer), else drawn from the row's logits."""
        logits = result.logits
        if batch.all_logits and logits is not None:  # prompt_logprobs rows: one per new token, whether sampled
            logits = split_prompt_logits(batch.seqs, batch.num_new_tokens, batch.all_logits, logits).float()
        if not samples:
            return [], []
        row_of = {id(batch.seqs[i]): i for i in rows}
        idx = [row_of[id(s)] for s, _ in samples]
        if result.token_ids is not None:  # the stage's tokens (and a split batch's logits for the rest)
            return stage_tokens(result.token_ids, result.logits, idx, samples, self._sample)
        return self._sample(samples, logits if idx == list(range(logits.shape[0])) else logits[idx])

    def _sample(self, samples: list[tuple[Sequence, int]],
                logits: torch.Tensor) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per (sequence, sample index) row of `logits` (sampling/metadata.py: how each draws)."""
        meta = SamplingMetadata.from_samples(samples, self.eos_token_ids)
        masks = self.grammars.fill(samples)
        if masks is not None:
            meta.bitmask, meta.masked_rows = masks
        return self.sampler.sample(logits, meta)

    def _delta(self, s: Sequence, tok: int, lp: TokenLogprobs | None) -> RequestDelta:
        p = s.sampling_params
        done = s.status is SequenceStatus.FINISHED
        d = RequestDelta(s.request_id, [tok], done, s.finish_reason, s.stop_reason if done else None,
                         s.num_preemptions, s.sample_index)
        if p.logprobs is not None:
            d.logprobs = [lp]
            d.cumulative_logprob = s.cumulative_logprob
        elif p.needs_logprobs:  # best_of ranks its samples by it
            d.cumulative_logprob = s.cumulative_logprob
        if s.sample_index == 0 and len(s.output_token_ids) == 1:  # the request's first token
            d.num_cached_tokens = s.num_cached_tokens
            if p.prompt_logprobs is not None:
                d.prompt_logprobs = list(s.prompt_logprobs or [None])
        return d

    def _observe(self, seq: Sequence) -> None:
        """A sequence finished (not aborted): forget its request once every sample is done, let the
        predictor learn its length, record it."""
        if seq.group.finished:
            self.requests.pop(seq.request_id, None)
        self.predictor.observe(seq)
        if self.history is not None:
            self._record(seq)

    # -- trace ---------------------------------------------------------------------------------------------
    def _bounded(self) -> deque:
        return deque(maxlen=self.config.trace_max_events)

    def reset_trace(self) -> None:
        self.trace_start = self.clock()
        self.kv_trace = self._bounded()
        self.kv_trace.append((self.trace_start, self.block_manager.usage()))
        self.engine_trace = self._bounded()
        self.executor.trace_events()  # drop what the stages recorded before
        self._stage_events = [self._bounded() for _ in range(self.pp)]

    def collect_stage_events(self) -> list[list[dict]]:
        """The stages' trace events since the last call (kept for trace() when tracing): what a live busy
        ratio is computed from. At pp > 1 this is a round trip that waits for the micro-batches in flight."""
        events = self.executor.trace_events()
        if self.tracing:
            for k, ev in enumerate(events):
                self._stage_events[k].extend(ev)
        return events

    def trace(self) -> dict[str, Any]:
        """The run's timeline (format tdpipe-trace/1, read by tdpipe.viz.timeline): per stage and micro-batch
        compute start/end, input wait, send time and shape; per micro-batch submit/result; KV usage.
        Only an engine built with collect_trace (or trace=FILE) keeps one."""
        if not self.tracing:
            raise RuntimeError("no trace was collected: create the engine with collect_trace=True "
                               "(or trace=FILE; --trace FILE on the command line)")
        self.collect_stage_events()
        t0 = self.trace_start

        def rel(e: dict, keys: tuple[str, ...]) -> dict:
            return {k: (round(v - t0, 6) if k in keys else v) for k, v in e.items()}

        stages = [{"stage": k, "layers": list(self.partition[k]), "threads": self.stage_threads[k],
                   "events": [rel(e, ("start", "end")) for e in self._stage_events[k]]} for k in range(self.pp)]
        return {
            "format": "tdpipe-trace/1",
            "pp": self.pp,
            "tp": self.tp,
            "policy": self.scheduler.config.policy,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}",
            "model": self.model_path,
            "stages": stages,
            "engine": [rel(e, ("submit", "done")) for e in self.engine_trace if "done" in e],
            "kv": [[round(t - t0, 6), round(u, 5)] for t, u in self.kv_trace],
            "preemptions": self.scheduler.num_preemptions,
        }

    def _record(self, seq: Sequence) -> None:
        from dataclasses import asdict

        from tdpipe.predictor.history import HistoryRecord
        params = {k: v for k, v in asdict(seq.sampling_params).items() if v is not None}
        self.history.write(HistoryRecord(self._prompt_text(seq), seq.num_prompt_tokens, seq.num_output_tokens,
                                         seq.finish_reason or "length", params, request_id=seq.request_id))

    def shutdown(self) -> None:
        """Stop the stages and drop the weights and the KV cache now (not at garbage collection: the engine
        is referenced from its scheduler's predictor, a cycle). Every later call raises. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.history is not None:
            self.history.close()
        self.grammars.close()
        try:
            self.executor.shutdown()
        finally:
            self.executor = _ClosedExecutor(self.executor.num_stages)
            self.clock = time.time  # was the old executor's bound method: it would keep the model alive
            self.requests.clear()
            self._inflight.clear()
            self.predictor = self.scheduler = self.sampler = self._batched = None  # type: ignore[assignment]


class _ClosedExecutor(Executor):
    """What a shut-down engine holds instead of its executor: no model, no KV cache, and every call raises."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages

    def submit(self, step: StepInput) -> None:
        raise RuntimeError("this engine was shut down; create a new LLM")

    def collect(self) -> StepResult:
        raise RuntimeError("this engine was shut down; create a new LLM")

    def drain(self) -> None:
        pass

    def trace_events(self) -> list[list[dict]]:
        return [[] for _ in range(self.num_stages)]
