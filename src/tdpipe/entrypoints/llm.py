"""`LLM`: the offline API, with vLLM's names (LLM, SamplingParams, generate, chat, RequestOutput)."""
from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from tdpipe.config import EngineConfig
from tdpipe.core import weight_sync
from tdpipe.core.engine import LLMEngine
from tdpipe.engine_args import EngineArgs
from tdpipe.entrypoints.conversation import check_conversation, template_conversation
from tdpipe.pipeline.executor import PipelineError
from tdpipe.interrupt import deferred_sigint, raise_if_dropped
from tdpipe.core.output_processor import OutputProcessor
from tdpipe.entrypoints.replicas import ReplicaRunner
from tdpipe.core.weight_sync import WeightSource
from tdpipe.core.validation import check_prompt
from tdpipe.outputs import CompletionOutput, Logprob, RequestOutput
from tdpipe.sampling.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from tdpipe.sampling.params import SamplingParams
from tdpipe.tokenizer import chat_prompt, check_template_kwargs, require_unicode

log = logging.getLogger("tdpipe")

PromptType = str | list[int] | dict[str, Any]


def engine_config(kw: dict[str, Any]) -> EngineConfig:
    """The EngineConfig that LLM()'s keywords describe (EngineArgs.from_kwargs(**kw).create_engine_config())."""
    return EngineArgs.from_kwargs(**kw).create_engine_config()


class LLM:
    """An engine over one model. `model=None` uses the bundled SmolLM2-135M-Instruct (converted once, offline).

    The keywords are EngineArgs' fields (tdpipe/engine_args.py: each with its default and help, the same as the
    command line's engine flags) and the registered policies' knobs (core/scheduler/registry.py), e.g.
    kv_cache_memory (bytes, or a fraction of available memory), pipeline_parallel_size, tensor_parallel_size,
    layer_partition, lm_head_split, scheduler, trace, collect_trace, record_history; throttle_T,
    max_prefill_tokens, min_prefill_tokens, kv_thresh (gLLM Eq. 3, scheduler="throttle"); future_points,
    switch_to_decode, switch_to_prefill, work_stealing (TD-Pipe §3.3-3.5, scheduler="td-pipe"). Any other
    keyword is a TypeError naming it. Use as a context manager, or call shutdown(), to stop stage workers promptly.
    """

    def __init__(self, model: str | None = EngineArgs.model, dtype: str = EngineArgs.dtype, **kwargs: Any) -> None:
        cfg = EngineArgs.from_kwargs(model=model, dtype=dtype, **kwargs).create_engine_config()
        self._req_ids = itertools.count()
        # data_parallel_size N > 1: N engine replicas in processes of their own (entrypoints/replicas.py);
        # `engine` is then None and generate() / chat() / update_weights(folder) go through the replicas
        self.replicas: ReplicaRunner | None = None
        self.engine: LLMEngine | None = None
        if cfg.parallel.data_parallel_size > 1:
            self.replicas = ReplicaRunner(cfg)
        else:
            self.engine = LLMEngine(cfg)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None) or getattr(self, "replicas", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer if self.engine is not None else self.replicas.tokenizer

    # -- generate ------------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | dict | Seq[SamplingParams | dict] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or {"prompt_token_ids": [...]}) in one continuous batch.

        A request with bad input (a prompt of the wrong type, empty or too long, invalid sampling params
        given as a dict) is returned with finish_reason "error" and `.error` set; the other requests still
        complete. Outputs come back in the order of `prompts`. A KeyboardInterrupt aborts this call's
        requests and frees their KV blocks: the next call works.
        """
        items = self._as_list(prompts)
        outputs: list[RequestOutput | None] = [None] * len(items)
        try:
            for i, out in self._generate(items, sampling_params, use_tqdm):
                if self.engine is not None:
                    out.weight_version = self.engine.weight_version
                outputs[i] = out
        except PipelineError as e:
            left = sum(1 for o in outputs if o is None)
            raise PipelineError(f"generate() failed: {e}; {left} of {len(outputs)} requests did not finish") from None
        return outputs  # type: ignore[return-value]

    def generate_unordered(self, prompts: PromptType | Seq[PromptType],
                           sampling_params: SamplingParams | dict | Seq[SamplingParams | dict] | None = None,
                           use_tqdm: bool = True) -> Iterator[tuple[int, RequestOutput]]:
        """Like generate(), but yields (index in `prompts`, output) as each request finishes, so a caller
        can save finished work at once (`tdpipe generate -o` writes each line as it comes). Rejected requests
        come first. Leaving the loop early, or an exception in it, aborts the requests still running."""
        return self._generate(self._as_list(prompts), sampling_params, use_tqdm)

    def _generate(self, items: list[PromptType], sampling_params: Any,
                  use_tqdm: bool) -> Iterator[tuple[int, RequestOutput]]:
        self._check_open()
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (SamplingParams, dict)):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(items)} prompts")
        if self.replicas is not None:
            yield from self._generate_replicated(items, params_list, use_tqdm)
            return
        live: dict[str, int] = {}  # request_id -> position in prompts
        proc = OutputProcessor(self.engine.tokenizer, stream=False, clock=self.engine.clock)
        rejected: list[tuple[int, RequestOutput]] = []
        for i, (prompt, sp) in enumerate(zip(items, params_list)):
            rid = str(next(self._req_ids))
            text, ids = None, None
            try:
                text, ids = self._split_prompt(prompt, i)
                if isinstance(sp, dict):
                    sp = SamplingParams(**sp)
                seq = self.engine.add_request(rid, text if text is not None else ids, sp, prompt_token_ids=ids)
                proc.add_request(rid, seq.prompt, seq.prompt_token_ids, sp, seq.arrival_time)
                live[rid] = i
            except (ValueError, TypeError) as e:
                rejected.append((i, _refused(rid, text, ids, e)))
        yield from rejected
        yield from self._run(live, proc, use_tqdm)

    def _generate_replicated(self, items: list[PromptType], params_list: list[Any],
                             use_tqdm: bool) -> Iterator[tuple[int, RequestOutput]]:
        """generate() over the data-parallel replicas: the same per-request errors, outputs as they finish."""
        jobs, rejected = [], []
        for i, (prompt, sp) in enumerate(zip(items, params_list)):
            rid = str(next(self._req_ids))
            text, ids = None, None
            try:
                text, ids = self._split_prompt(prompt, i)
                jobs.append((i, rid, text, ids, SamplingParams(**sp) if isinstance(sp, dict) else sp))
            except (ValueError, TypeError) as e:
                rejected.append((i, _refused(rid, text, ids, e)))
        yield from rejected
        bar = None
        if use_tqdm and jobs:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(jobs), desc=f"Processed prompts ({len(self.replicas.client.replicas)} replicas)",
                       dynamic_ncols=True)
        try:
            for i, out in self.replicas.run(jobs):
                if bar is not None:
                    bar.update(1)
                yield i, out
        finally:
            if bar is not None:
                bar.close()

    def _run(self, live: dict[str, int], proc: OutputProcessor,
             use_tqdm: bool) -> Iterator[tuple[int, RequestOutput]]:
        bar = None
        if use_tqdm and live:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(live), desc="Processed prompts", dynamic_ncols=True)
        engine = self.engine
        engine.reset_trace()
        t0 = time.perf_counter()
        out0, in0 = engine.stats.output_tokens, engine.stats.prompt_tokens
        last = 0.0
        left = len(live)
        try:
            while left:
                raise_if_dropped()  # a Ctrl-C the interpreter dropped while the engine started (interrupt.py)
                with deferred_sigint():  # Ctrl-C lands between steps, never inside the page table
                    done, stopped = proc.process(engine.step())
                    if stopped:  # a stop string, found by the output processor: the core drops them
                        engine.abort_samples(stopped, reason="stop")
                for out in done:
                    left -= 1
                    if bar is not None:
                        bar.update(1)
                    yield live[out.request_id], out
                if bar is not None and time.perf_counter() - last > 0.5:
                    last = time.perf_counter()
                    dt = last - t0
                    bar.set_postfix_str(f"in: {(engine.stats.prompt_tokens - in0) / dt:.0f} tok/s, "
                                        f"out: {(engine.stats.output_tokens - out0) / dt:.0f} tok/s", refresh=False)
        except BaseException:  # KeyboardInterrupt, PipelineError, the caller leaving early (GeneratorExit)
            if not engine.closed:
                engine.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()
        if engine.config.trace:
            with open(engine.config.trace, "w") as f:
                f.write(json.dumps(engine.trace()))  # as json.dump writes it, 3x sooner (the C encoder)

    def trace(self) -> dict[str, Any]:
        """The last generate() call's timeline (tdpipe-trace/1): per stage, per micro-batch compute, waits,
        sends and shapes, plus KV usage; `tdpipe.viz.timeline.summarize` turns it into bubble ratios."""
        return self._one_engine("trace()").trace()

    @staticmethod
    def _as_list(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, (str, dict, _Rejected)) or not hasattr(prompts, "__iter__"):
            return [prompts]  # one prompt (of the wrong type, it fails as its own request)
        items = list(prompts)
        if items and all(isinstance(t, int) for t in items):  # one prompt given as token ids
            return [items]
        return items

    @staticmethod
    def _split_prompt(prompt: PromptType, index: int = 0) -> tuple[str | None, list[int] | None]:
        """(text, token ids) of one prompt; ValueError naming the prompt when it has the wrong shape."""
        if isinstance(prompt, _Rejected):
            raise ValueError(prompt.error)
        if isinstance(prompt, str):
            return require_unicode(prompt, f"prompt {index}"), None
        if isinstance(prompt, dict):
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"prompt {index}: 'prompt' must be a string, got {type(text).__name__}")
            if text is not None:
                require_unicode(text, f"prompt {index}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(type(t) is int for t in ids):
                    raise ValueError(f"prompt {index}: 'prompt_token_ids' must be a list of integers")
                return text, list(ids)
            if text is None:
                raise ValueError(f"prompt {index}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
            return text, None
        if isinstance(prompt, (list, tuple)):
            if not all(type(t) is int for t in prompt):
                raise ValueError(f"prompt {index}: a token-id list must hold only integers")
            return None, list(prompt)
        raise ValueError(f"prompt {index}: expected a string, a list of token ids or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    # -- beam search ---------------------------------------------------------------------------------
    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search (sampling/beam_search.py): each prompt's beam_width best sequences,
        each with its tokens (prompt and output), output logprobs, cumulative logprob and text. A prompt of
        the wrong shape, empty or too long is a ValueError naming it; nothing runs then."""
        engine = self._one_engine("beam_search()")
        tok = engine.tokenizer
        ids_list = []
        for i, prompt in enumerate(self._as_list(prompts)):
            text, ids = self._split_prompt(prompt, i)
            ids = engine.encode_prompt(text) if ids is None else ids
            check_prompt(ids, engine.request_limits, f"prompt {i}")
            ids_list.append(ids)

        def step(token_lists: list[list[int]]) -> list[dict[int, Logprob]]:
            outs = self.generate([{"prompt_token_ids": t} for t in token_lists], params.step_params(),
                                 use_tqdm=use_tqdm)
            bad = next((o.error for o in outs if o.error), None)
            if bad is not None:
                raise ValueError(f"beam_search: a step was refused: {bad}")
            return [o.outputs[0].logprobs[0] for o in outs]

        decode = None if tok is None else (lambda t: tok.decode(t, skip_special_tokens=True))
        return beam_search(ids_list, params, step, frozenset(engine.eos_token_ids),
                           engine.scheduler.config.max_model_len, decode)

    # -- chat ----------------------------------------------------------------------------------------
    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None, chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.
        `continue_final_message`: the model continues the last message (a prefilled start of the answer)
        instead of opening a new turn; give add_generation_prompt=False with it (vLLM's rule).
        `chat_template_kwargs`: more variables for the template (Qwen3's {"enable_thinking": False}).
        `tools`: OpenAI's tool definitions, the template's `tools` (vLLM's keyword); the answer's calls are
        left in its text (the server parses them: docs/serving.md). `chat_template`: a Jinja template used
        instead of the model's (vLLM's keyword)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        template_kwargs = check_template_kwargs(chat_template_kwargs)  # a bad one fails the call, before any run
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat() needs the model's tokenizer and chat template; this LLM has none "
                             "(skip_tokenizer_init=True): give token ids to generate()")
        prompts: list[PromptType] = []
        for i, conv in enumerate(convs):
            try:  # a malformed conversation fails as its own request, with the message's number
                conv = template_conversation(check_conversation(conv))
                text, ids = chat_prompt(tok, conv, add_generation_prompt, continue_final_message, template_kwargs,
                                        tools, chat_template)
                prompts.append({"prompt": text, "prompt_token_ids": ids})
            except Exception as e:  # noqa: BLE001 - the template's own errors (jinja) too
                prompts.append(_Rejected(f"conversation {i}: {e}"))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # -- weights and memory between calls (core/weight_sync.py) -------------------------------------------
    def update_weights(self, weights: WeightSource) -> int:
        """New weights without a restart: a checkpoint folder (each pipeline stage and tensor-parallel rank
        loads its own slices), or an iterable of (Hugging Face name, tensor) at pp = tp = 1. Runs between
        generate() calls, so every request finishes on the weights it started with; the prefix cache is
        emptied. Returns the new weight version (RequestOutput.weight_version)."""
        self._check_open()
        if self.replicas is not None:
            if not isinstance(weights, str):
                raise ValueError("with data_parallel_size > 1, update_weights takes a checkpoint folder: the "
                                 "replicas are other processes")
            return self.replicas.update_weights(weights)
        return weight_sync.update_weights(self.engine, weights)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights too (level 2) until wake_up(); generate() raises
        meanwhile."""
        weight_sync.sleep(self._one_engine("sleep()"), level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what sleep() freed (level 2: the weights reload from the checkpoint folder). `tags`
        (vLLM's): only these parts, "weights" or "kv_cache": wake_up(tags=["weights"]), update_weights(...),
        wake_up(tags=["kv_cache"]) never holds new weights beside the old KV cache."""
        weight_sync.wake_up(self._one_engine("wake_up()"), tags)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's; update_weights does it itself). Between generate() calls;
        returns False, doing nothing, while requests are unfinished."""
        return weight_sync.reset_prefix_cache(self._one_engine("reset_prefix_cache()"))

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses when given no SamplingParams (vLLM's): the model's generation_config.json
        defaults (temperature, top_p, ...; sampling/defaults.py) over SamplingParams' own."""
        defaults = self.engine.default_sampling if self.engine is not None else self.replicas.default_sampling
        return SamplingParams(**defaults)

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine (`self.engine`)."""
        return self._one_engine("llm_engine")

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call `method` of every worker's ModelRunner with `args`, between steps; results in worker order
        (vLLM's LLM.collective_rpc, for custom weight loading)."""
        return self._one_engine("collective_rpc()").executor.collective_rpc(method, args)

    def shutdown(self) -> None:
        """Stop the stage workers and release the weights and the KV cache; every later call raises."""
        (self.engine or self.replicas).shutdown()

    def _check_open(self) -> None:
        if (self.engine or self.replicas).closed:
            raise RuntimeError("this LLM was shut down; create a new one")

    def _one_engine(self, what: str) -> LLMEngine:
        """The engine, for what only one engine in this process can do."""
        self._check_open()
        if self.engine is None:
            raise ValueError(f"{what} needs data_parallel_size 1: the replicas are other processes")
        return self.engine


def _refused(rid: str, text: str | None, ids: list[int] | None, e: Exception) -> RequestOutput:
    """The output of a request refused at submit time: finish_reason "error" and the reason (logged)."""
    log.warning("request %s rejected: %s", rid, e)
    return RequestOutput(rid, text, [t for t in ids or [] if isinstance(t, int)],
                         [CompletionOutput(0, "", [], "error")], error=str(e))


@dataclass
class _Rejected:
    """A prompt already known to be invalid (a malformed conversation): generate() reports it as an error."""

    error: str
