"""The control plane (TD-Pipe §3.2): schedule -> submit -> collect -> sample -> scheduler.update_from_output.

The engine owns the requests, the page table (BlockManager) and the sampler; an Executor owns the compute.
It keeps up to `executor.num_stages` micro-batches in flight so a pipeline never waits on the engine. It
works in token ids: each step returns per-request deltas (core/delta.py); text and stop strings are the
frontend's (core/output_processor.py).
"""
from __future__ import annotations

import itertools
import json
import platform
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tdpipe.config import EngineConfig, ModelConfig, cpu_supports_bf16, default_threads
from tdpipe.core.batch import Batch, StepInput
from tdpipe.core.delta import RequestDelta, TokenLogprobs
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.predictor import Predictor, make_predictor
from tdpipe.core.scheduler import get_policy, make_scheduler
from tdpipe.executor.base import Executor, StepResult
from tdpipe.malloc import pin_mmap_threshold
from tdpipe.model.weights import check_model_folder, load_hf_config
from tdpipe.sampling.params import SamplingParams
from tdpipe.sampling.sampler import Sampler, draw_keys, sample_seed
from tdpipe.sequence import Sequence, SequenceStatus
from tdpipe.tokenizer import load_tokenizer

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
    mixed_steps: int = 0  # hybrid: decodes and prefill chunks in one micro-batch
    predict_seconds: float = 0.0  # time spent predicting output lengths (batched, as requests arrive)
    predicted: int = 0
    started: float = field(default_factory=time.time)


class _BatchOnMiss(Predictor):
    """The predictor the scheduler sees when predictions are batched: asked about a request whose batch has
    not been predicted yet, it predicts the next chunk of arrivals with that request first, instead of one
    prompt at a time."""

    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self.inner = engine.predictor
        self.name = self.inner.name

    def predict(self, seq: Sequence) -> int:
        if seq.predicted_output_len is None:
            self.engine._predict_pending(first=seq)
        if seq.predicted_output_len is None:  # not the batched model's (e.g. an ignore_eos request: oracle)
            return self.inner.predict(seq)
        return seq.predicted_output_len

    def observe(self, seq: Sequence) -> None:
        self.inner.observe(seq)


ExecutorFactory = Callable[["LLMEngine"], Executor]


class LLMEngine:
    """`executor_factory`: build the executor from the engine (its model_config, partition, block manager)
    instead of loading weights; the simulator (sim/executor.py) runs the same loop this way. Such an engine
    loads no tokenizer: requests come as token ids, and time is the executor's clock."""

    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory | None = None) -> None:
        from tdpipe.pipeline.executor import run_stage_if_worker
        from tdpipe.model.bundled import resolve_model

        par = config.parallel
        run_stage_if_worker(par.pipeline_parallel_size, par.tensor_parallel_size)  # torchrun ranks > 0: workers
        pin_mmap_threshold()  # per-step [batch, vocab] tensors must not fragment the heap (tdpipe/malloc.py)
        self.config = config
        self.model_path = resolve_model(config.model)
        # every part of the folder checked before anything heavy starts (stages, kernels): one clear line
        hf = load_hf_config(self.model_path) if executor_factory is not None else check_model_folder(self.model_path)
        self.model_config = ModelConfig.from_hf(hf)
        self.clock: Callable[[], float] = time.time  # the executor's clock once it exists
        self.tokenizer = load_tokenizer(self.model_path) if executor_factory is None else None
        self.eos_token_ids = self._eos_ids(hf)
        self.dtype = resolve_dtype(config.dtype)
        self.pp = config.parallel.pipeline_parallel_size
        self.tp = config.parallel.tensor_parallel_size
        # workers of their own: they own the cores; the engine process only samples and schedules
        torch.set_num_threads(config.num_threads or (default_threads() if config.parallel.world_size == 1 else 1))

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
        num_blocks = cache.num_blocks or cache.budget_bytes() // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory: {cache.budget_bytes()} bytes hold no KV block (one block of "
                             f"{cache.block_size} tokens needs {block_bytes} bytes for this model in "
                             f"{str(self.dtype).removeprefix('torch.')})")
        capacity = num_blocks * cache.block_size
        if capacity < sched.max_model_len:
            # visible: every request is cut to this length, so a silent change would look like a short answer
            log.warning("the KV cache holds only %d tokens (%d blocks of %d): max_model_len lowered from %d to "
                        "%d; a prompt and its output must fit in it (raise --kv-cache-memory for more)",
                        capacity, num_blocks, cache.block_size, sched.max_model_len, capacity)
            sched.max_model_len = capacity
        sched.pipeline_depth = self.pp
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        policy = get_policy(sched.policy)  # what the policy needs: a length predictor, measured step costs
        self.predictor = make_predictor(sched.predictor, self.model_path)
        # a learned predictor encodes prompts in batches as they arrive, for the policies that ask for lengths
        self._batched = policy.needs_predictor and self.predictor.batched
        self._unpredicted: deque[Sequence] = deque()
        for p in (self.predictor, getattr(self.predictor, "fallback", None)):
            if hasattr(p, "text_of"):
                p.text_of = self._prompt_text
        self.history = None
        if config.record_history:
            from tdpipe.predictor.history import HistoryWriter
            self.history = HistoryWriter(config.record_history, model=os.path.basename(
                os.path.normpath(self.model_path)))
        self.scheduler = make_scheduler(sched, self.block_manager,
                                        predictor=_BatchOnMiss(self) if self._batched else self.predictor)
        self.scheduler.eos_token_ids = frozenset(self.eos_token_ids)
        if executor_factory is None:
            self.executor = self._make_executor(num_blocks)
        else:
            from tdpipe.worker.partition import resolve_partition

            self.partition = resolve_partition(mc, self.pp, config.parallel.layer_partition)
            self.lm_head_split = config.parallel.lm_head_split or 0.0
            self.stage_threads = [config.parallel.stage_threads()] * self.pp
            self.executor = executor_factory(self)
        self.clock = self.executor.now
        self.sampler = Sampler()
        self._seq_ids = itertools.count()
        self.stats = EngineStats(started=self.clock())
        self._inflight: deque[Batch] = deque()
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id (abort_request looks them up)
        self._closed = False
        self.tracing = config.collect_trace
        self.trace_start = self.clock()
        self.kv_trace: deque[tuple[float, float]] = self._bounded()  # (time, KV usage): TD-Pipe Fig. 12
        self.engine_trace: deque[dict] = self._bounded()  # per micro-batch: submit and result times
        self._stage_events: list[deque[dict]] = [self._bounded() for _ in range(self.pp)]
        torch.manual_seed(config.seed)
        if policy.wants_step_costs(sched):
            from tdpipe.core.step_profile import load_or_measure, measure

            # Eq. 1-2 on measured costs (a simulated executor is profiled afresh: its clock is the cost model)
            self.scheduler.costs = (measure(self, max_batch=512) if executor_factory is not None
                                    else load_or_measure(self, sched.profile_cache))

    def _eos_ids(self, hf: dict[str, Any]) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        try:
            with open(os.path.join(self.model_path, "generation_config.json")) as f:
                e = json.load(f).get("eos_token_id")
            ids.update([e] if isinstance(e, int) else (e or []))
        except (OSError, ValueError):
            pass
        return ids

    def _make_executor(self, num_blocks: int) -> Executor:
        from tdpipe.worker.partition import StageCosts, choose_head_split, resolve_partition

        par = self.config.parallel
        split = par.lm_head_split  # None: auto (pp > 1, tp = 1 only)
        auto = split is None and self.pp > 1 and self.tp == 1
        counts = par.layer_partition
        costs = None
        if self.pp > 1 and (counts is None or auto):
            # balance by measured time (a decode micro-batch and a prefill), not by layer count or FLOPs
            batch = max(8, min(128, self.scheduler.config.max_num_seqs // self.pp))
            costs = StageCosts.measure(self.model_config, self.dtype, par.stage_threads(), batch=batch)
            if auto:
                split, counts = choose_head_split(self.model_config, self.pp, costs, counts)
            costs = costs.with_split(split or 0.0)  # the costs the partition and the log below go by
        self.lm_head_split = split or 0.0
        self.partition = resolve_partition(self.model_config, self.pp, counts, costs)
        if self.tp > 1:  # an unsplittable model fails here, naming its sizes, before any worker starts
            from tdpipe.model.tensor_parallel import head_split

            head_split(self.model_config.num_heads, self.model_config.num_kv_heads, self.tp)
        if self.pp > 1:
            log.info("layer partition %s (embedding on stage 0, norm + lm_head on stage %d, %.0f%% of the head "
                     "on stage 0; costs %s)", [b - a for a, b in self.partition], self.pp - 1,
                     100 * self.lm_head_split, costs)
        if self.pp == 1 and self.tp == 1:
            from tdpipe.executor.local import LocalExecutor
            from tdpipe.worker.model_runner import ModelRunner

            runner = ModelRunner(self.model_config, self.model_path, self.dtype, num_blocks,
                                 self.config.cache.block_size)
            self.stage_threads = [torch.get_num_threads()]
            return LocalExecutor(runner)
        from tdpipe.pipeline.executor import PipelineExecutor, StageSpec

        threads = par.stage_threads()
        self.stage_threads = [threads] * self.pp
        stages = [StageSpec(a, b, threads) for a, b in self.partition]
        return PipelineExecutor(self.model_config, self.model_path, self.dtype, num_blocks,
                                self.config.cache.block_size, stages,
                                self._max_batch_tokens(), par.device, self.tp, self.lm_head_split)

    def _max_batch_tokens(self) -> int:
        """Tokens the stages' receive buffers must hold: separate and td-pipe send a lone prompt longer
        than the budget whole (they never chunk), so max_model_len bounds a batch as well."""
        cfg = self.scheduler.config
        return max(cfg.max_num_batched_tokens, cfg.max_model_len)

    # -- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    prompt_token_ids: list[int] | None = None) -> Sequence:
        """Validate and queue a request. Raises ValueError naming the problem; nothing is queued then."""
        self._check_open()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("this engine has no tokenizer (simulated): give prompt_token_ids")
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
        if self.tokenizer is None and params.stop:  # they would never match: no output processor can decode
            raise ValueError("stop strings need a tokenizer; this engine has none (simulated)")
        seq = Sequence(next(self._seq_ids), request_id, list(prompt_token_ids), params, prompt=text,
                       max_tokens=max_tokens, arrival_time=self.clock())
        if params.num_samples > self.scheduler.config.max_num_seqs:
            raise ValueError(f"{'best_of' if params.best_of else 'n'} is {params.num_samples}, more samples than "
                             f"max_num_seqs ({self.scheduler.config.max_num_seqs}) lets run at once")
        if params.num_samples > 1:  # n / best_of: forked from this one once its prompt is prefilled
            seq.samples_to_fork = params.num_samples - 1
            seq.group = [seq]
        self.scheduler.add(seq)
        self.requests[request_id] = seq
        if self._batched:
            self._unpredicted.append(seq)
        return seq

    def _prompt_text(self, seq: Sequence) -> str:
        if seq.prompt is None:
            seq.prompt = self.tokenizer.decode(seq.prompt_token_ids)
        return seq.prompt

    PREDICT_CHUNK = 64  # prompts per predictor batch

    def _predict_pending(self, first: Sequence | None = None) -> None:
        """Predict output lengths for up to PREDICT_CHUNK arrived requests in one batch. Called while the
        stages compute (after the pipeline is filled), so it stays off the pipeline's critical path; before
        the first batch it runs first, since Algorithm 1 needs the lengths to admit anything; and when the
        scheduler asks about a request not predicted yet (`first`), which then leads the batch."""
        chunk = [first] if first is not None else []
        while self._unpredicted and len(chunk) < self.PREDICT_CHUNK:
            s = self._unpredicted.popleft()
            if s.predicted_output_len is None and not s.is_finished and s is not first:
                chunk.append(s)
        if chunk:
            t = time.perf_counter()
            self.stats.predicted += self.predictor.predict_batch(chunk)
            self.stats.predict_seconds += time.perf_counter() - t

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine was shut down; create a new LLM")

    # -- abort ---------------------------------------------------------------------------------------
    def abort_request(self, request_ids: str | list[str | tuple[str, int]], reason: str = "abort") -> list[Sequence]:
        """Finish these requests now with finish_reason "abort" (unknown or finished ids are ignored). An id
        is a request id (all its samples) or (request id, sample index) for one sample of an n > 1 request;
        before the samples are forked (the prompt still prefilling), sample k > 0 is then never forked, and
        sample 0, the sequence that carries the shared prompt, takes the whole request with it.
        reason="stop": the frontend found a stop string; the request counts as finished normally (the
        predictor learns its length, --record-history records it).

        A waiting or idle running sequence leaves its queue and frees its KV blocks at once. One inside a
        micro-batch still in flight keeps its blocks until that batch returns (the stages may still write
        them); its result is then dropped and the blocks freed by the scheduler as for any finished request.
        Returns the sequences aborted."""
        ids = [request_ids] if isinstance(request_ids, (str, tuple)) else list(request_ids)
        done = []
        now = self.clock()
        for rid in ids:
            one = None
            if isinstance(rid, tuple):
                rid, one = rid
            head = self.requests.get(rid)
            if head is None:
                continue
            if one is not None and one > 0 and head.samples_to_fork and not head.is_finished:
                head.aborted_samples.add(one)  # not forked yet: it never will be (its prompt is shared)
                continue
            for seq in list(head.samples()):
                if seq.is_finished or (one is not None and seq.sample_index != one):
                    continue
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason, seq.finish_time = reason, now
                seq.samples_to_fork = 0  # an aborted parent forks nothing
                if reason != "abort":
                    self._observe(seq)
                if not seq.in_flight:
                    self.scheduler.abort(seq)
                    self.executor.release([seq.seq_id])
                done.append(seq)
            if all(s.is_finished for s in head.samples()):
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
        bm = self.block_manager
        if bm.num_free_blocks != bm.num_blocks:
            # only an interrupt inside an allocation can get here: nothing runs, so every block is free
            log.warning("abort: %d KV blocks were still referenced with no request left; freeing them",
                        bm.num_blocks - bm.num_free_blocks)
            bm.reset()
        return seqs

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Keep the pipeline full (up to pp micro-batches in flight), then complete the oldest one.
        Returns a delta for every request that got a token in it (aborted requests get none: abort_request
        returned them)."""
        self._check_open()
        if self._unpredicted and not self._inflight:
            self._predict_pending()
        while len(self._inflight) < self.executor.num_stages:
            batch = self.scheduler.schedule()
            if batch is None:
                break
            if self.tracing:
                now = self.clock()
                self.engine_trace.append({"batch_id": batch.batch_id, "submit": now})
                self.kv_trace.append((now, self.block_manager.usage()))  # blocks are taken at schedule time
            batch.block_copies = self.scheduler.take_block_copies()
            self.executor.submit(self._to_step(batch))
            self._inflight.append(batch)
        if self._unpredicted and self._inflight:
            self._predict_pending()
        if not self._inflight:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (KV cache too small?)")
            return []
        result = self.executor.collect()
        batch = self._inflight.popleft()  # after collect: an interrupted wait leaves the batch in flight
        aborted = [s.seq_id for s in batch.seqs if s.is_finished]  # while in flight: result dropped
        deltas, finished = self._finish(batch, result)
        if self.tracing:
            self.engine_trace[-len(self._inflight) - 1]["done"] = self.clock()
        if finished or aborted:
            self.executor.release([s.seq_id for s in finished] + aborted)
        return deltas

    def _to_step(self, batch: Batch) -> StepInput:
        step = StepInput.from_batch(batch)
        step.greedy_rows = [p.is_greedy and not p.needs_penalties and not p.needs_logprobs
                            and len(s.output_token_ids) >= p.min_tokens and not s.needs_prompt_logits
                            for s, p in ((s, s.sampling_params) for s in batch.seqs)]
        if any(s.needs_prompt_logits for s in batch.seqs):
            batch.all_logits = step.all_logits = [s.needs_prompt_logits for s in batch.seqs]
        return step

    def _finish(self, batch: Batch, result: StepResult) -> tuple[list[RequestDelta], list[Sequence]]:
        # decode rows: one new token over a cached prefix (the rest is prompt being prefilled)
        n_decode = sum(1 for s, n in zip(batch.seqs, batch.num_new_tokens)
                       if n == 1 and s.num_computed_tokens > 0)
        rows = batch.sampled_rows()  # a prefill chunk short of the prompt's end samples nothing
        seqs = [batch.seqs[i] for i in rows]
        logits = result.logits
        if batch.all_logits and logits is not None:  # prompt_logprobs rows hold one row per new token
            logits = self._split_prompt_logits(batch, logits, rows)
        forks: dict[int, list[tuple[Sequence, int]]] = {}
        lps: list[TokenLogprobs | None] = [None] * len(seqs)
        child_lps: dict[int, TokenLogprobs | None] = {}
        if result.token_ids is not None:  # greedy-only batch: the last stage sent argmax ids
            tokens = [result.token_ids[i] for i in rows]
            for s, t in zip(seqs, tokens):
                if s.samples_to_fork:  # greedy samples are all the same answer
                    forks[s.seq_id] = [(s.fork(next(self._seq_ids), j), t) for j in range(1, s.samples_to_fork + 1)
                                       if j not in s.aborted_samples]
        elif rows:
            tokens, lps = self._sample_rows(seqs, logits if len(rows) == len(batch.seqs) or batch.all_logits
                                            else logits[rows], forks, child_lps)
        else:
            tokens = []
        finished = self.scheduler.update_from_output(batch, tokens, forks)
        now = self.clock()
        for seq in seqs:
            if seq.first_token_time is None:
                seq.first_token_time = now
        for seq in finished:
            seq.finish_time = now
            self._observe(seq)
        if n_decode == len(batch.seqs):
            self.stats.decode_steps += 1
        elif n_decode:
            self.stats.mixed_steps += 1
        else:
            self.stats.prefill_steps += 1
        self.stats.prompt_tokens += batch.num_tokens - n_decode
        self.stats.output_tokens += len(seqs) + sum(len(c) for c in forks.values())
        if self.tracing:
            self.kv_trace.append((now, self.block_manager.usage()))
        deltas = []
        for s, t, lp in zip(seqs, tokens, lps):
            deltas.append(self._delta(s, t, lp))
            for child, ct in forks.get(s.seq_id, ()):
                deltas.append(self._delta(child, ct, child_lps.get(child.seq_id)))
        return deltas, finished

    def _delta(self, s: Sequence, tok: int, lp: TokenLogprobs | None) -> RequestDelta:
        p = s.sampling_params
        d = RequestDelta(s.request_id, [tok], s.is_finished, s.finish_reason,
                         s.stop_reason if s.is_finished else None, s.num_preemptions, index=s.sample_index)
        if p.logprobs is not None:
            d.logprobs = [lp]
        if p.needs_logprobs:
            d.cumulative_logprob = s.cumulative_logprob
        if p.prompt_logprobs is not None and s.sample_index == 0 and len(s.output_token_ids) == 1:
            d.prompt_logprobs = list(s.prompt_logprobs or [None])
        return d

    def _split_prompt_logits(self, batch: Batch, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """A batch with prompt_logprobs rows returns every new token's logits for them: turn those into the
        prompt's logprobs (per position: the actual next prompt token, its rank, the top-k; from the
        model's raw distribution) and return the sampled rows' last-token logits."""
        last: list[int] = []
        r = 0
        for seq, q, full in zip(batch.seqs, batch.num_new_tokens, batch.all_logits):
            width = q if full else 1
            if full:
                self._prompt_logprobs(seq, logits[r:r + width])
            last.append(r + width - 1)
            r += width
        return logits[[last[i] for i in rows]]

    def _prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Append the logprobs of prompt positions start+1 .. for this chunk (start: its first token's
        position), skipping positions already known (a prompt recomputed after preemption)."""
        start = seq.num_computed_tokens
        k = seq.sampling_params.prompt_logprobs
        prompt = seq.prompt_token_ids
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        have = len(seq.prompt_logprobs)  # row j predicts position start + j + 1; the known ones are skipped
        js = [j for j in range(logits.shape[0]) if have <= start + j + 1 < len(prompt)]
        if not js:
            return
        out: list[TokenLogprobs | None] = [None] * len(js)
        Sampler._logprobs(logits[js].to(torch.float32), [prompt[start + j + 1] for j in js], list(range(len(js))),
                          [k] * len(js), out)
        seq.prompt_logprobs.extend(out)

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor, forks: dict[int, list[tuple[Sequence, int]]],
                     child_lps: dict[int, TokenLogprobs | None]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample each row; a parent of an n > 1 request whose first token this is samples one token per
        sample from its row (each with its own key), and its children are created here (in `forks`)."""
        entries: list[tuple[Sequence, int]] = []  # (sequence, sample index)
        idx: list[int] = []
        for j, s in enumerate(seqs):
            entries.append((s, s.sample_index))
            idx.append(j)
            for k in range(1, s.samples_to_fork + 1):
                if k in s.aborted_samples:
                    continue
                entries.append((s, k))
                idx.append(j)
        if len(idx) != len(seqs):
            logits = logits[idx]
        toks, lps = self._sample(entries, logits)
        before = {s.seq_id: s.cumulative_logprob for s in seqs}  # a child forks from the parent's value before
        tokens: list[int] = []
        out_lps: list[TokenLogprobs | None] = []
        for (s, k), t, lp in zip(entries, toks, lps):
            if k == s.sample_index:
                tokens.append(t)
                out_lps.append(lp)
                if lp is not None:
                    s.cumulative_logprob += lp[0][1]
            else:
                child = s.fork(next(self._seq_ids), k)
                child_lps[child.seq_id] = lp
                child.cumulative_logprob = before[s.seq_id] + (lp[0][1] if lp is not None else 0.0)
                forks.setdefault(s.seq_id, []).append((child, t))
        return tokens, out_lps

    def _observe(self, seq: Sequence) -> None:
        """A sequence finished (not aborted): forget its request once every sample is done, let the
        predictor learn its length, record it."""
        if all(s.is_finished for s in seq.samples()):
            self.requests.pop(seq.request_id, None)
        self.predictor.observe(seq)
        if self.history is not None:
            self._record(seq)

    def _sample(self, entries: list[tuple[Sequence, int]],
                logits: torch.Tensor) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per (sequence, sample index) entry. A seeded row's randomness is keyed by (seed of
        that sample, index of the token being sampled), not kept in a per-request generator: a request
        recomputed after preemption samples position i with the same draw as without preemption, whatever
        was sampled or dropped meanwhile, and sample i of a request is the same whatever shares the batch."""
        seqs = [s for s, _ in entries]
        params = [s.sampling_params for s in seqs]
        eos = sorted(self.eos_token_ids)
        banned: list[list[int]] = []
        for s, p in zip(seqs, params):  # no stop token before min_tokens; the sampler masks them in its copy
            short = len(s.output_token_ids) < p.min_tokens
            banned.append(([] if p.ignore_eos else eos) + list(p.stop_token_ids or []) if short else [])
        need_hist = [p.needs_penalties for p in params]
        prompts = [s.prompt_token_ids if h else [] for s, h in zip(seqs, need_hist)]
        outs = [s.output_token_ids if h else [] for s, h in zip(seqs, need_hist)]
        keys: list[int | None] = [None] * len(seqs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if seeded:
            for i, k in zip(seeded, draw_keys([sample_seed(params[i].seed, entries[i][1]) for i in seeded],
                                              [len(seqs[i].output_token_ids) for i in seeded])):
                keys[i] = k
        ks = [(p.logprobs or 0) if p.needs_logprobs else None for p in params]
        return self.sampler.sample(logits, params, prompts, outs, keys, banned if any(banned) else None,
                                   ks if any(k is not None for k in ks) else None)

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
        try:
            self.executor.shutdown()
        finally:
            self.executor = _ClosedExecutor(self.executor.num_stages)
            self.clock = time.time  # was the old executor's bound method: it would keep the model alive
            self.requests.clear()
            self._inflight.clear()
            self.predictor = self.scheduler = self.sampler = None  # type: ignore[assignment]


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
