"""EngineArgs: every engine argument, declared once (vLLM's EngineArgs idea).

Each field holds its default (the config dataclass's own, tdpipe/config.py), its help and its flag
(tdpipe/options.py). From it come the engine flags of every command (`tdpipe generate`, `chat`, `serve`,
`run-batch`, `bench ...`; `simulate` takes the scheduler's part), the keywords `LLM(...)` accepts (filtered
through the fields, as nano-vllm does), and the EngineConfig the engine is built from (`create_engine_config`).
A policy's own knobs (throttle_T, future_points, ...) are not fields here: each policy declares them in its
registry spec (core/scheduler/registry.py), and they travel in `knobs`, so a new policy with knobs is one file.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from tdpipe.config import (DEVICES, DISAGGREGATIONS, GENERATION_CONFIGS, KV_CACHE_DTYPES, QUANTIZATIONS,
                           SAMPLING_DEVICES, CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig)
from tdpipe.core.scheduler.registry import get_policy, knob_owners, policies, policy_names
from tdpipe.ignored_args import add_ignored_flags, drop_ignored, warn_ignored_flags
from tdpipe.options import add_flag, add_flags, flagged, from_namespace, json_object, option
from tdpipe.platforms import check_device
from tdpipe.predictor.factory import check_predictor_spec


# -- flag value types ------------------------------------------------------------------------------------
def parse_memory(v: str) -> int | float:
    """'0.3' is a fraction of available memory; '2GiB', '512MiB' or a plain integer are bytes."""
    s = v.strip()
    units = {"gib": 1 << 30, "gb": 10**9, "mib": 1 << 20, "mb": 10**6, "kib": 1 << 10}
    for u, m in units.items():
        if s.lower().endswith(u):
            return int(float(s[: -len(u)]) * m)
    if "." in s:
        return float(s)
    return int(s)


def _positive_ints(v: str, flag: str, what: str, example: str, too_small: str) -> list[int]:
    """A comma-separated list of integers >= 1 (`what`, e.g. `example`); argparse's error names `flag`."""
    try:
        parts = [int(x) for x in v.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} {v!r}: expected comma-separated {what}, e.g. {example}") from None
    if any(n < 1 for n in parts):
        raise argparse.ArgumentTypeError(f"{flag} {v!r}: {too_small}")
    return parts


def parse_partition(v: str) -> list[int]:
    """'18,12': layers per stage."""
    return _positive_ints(v, "--layer-partition", "layer counts", "18,12", "every stage needs at least one layer")


def parse_head_split(v: str) -> float | None:
    """'auto' (None) or a fraction in [0, 1) (ParallelConfig checks the range)."""
    if v.strip().lower() == "auto":
        return None
    try:
        return float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1) or 'auto', got {v!r}") from None


def parse_graph_sizes(v: str) -> list[int]:
    """'1,2,4,8': the decode batch sizes captured as CUDA graphs."""
    return _positive_ints(v, "--cuda-graph-sizes", "batch sizes", "1,2,4,8", "every batch size must be >= 1")


def _policy_help() -> str:
    helps = "; ".join(f"{s.name} = {s.help}" for s in policies()).replace("%", "%%")  # argparse formats help
    return "batching policy (default: %(default)s): " + helps


def _budget_help() -> str:
    per = "; ".join(f"{s.default_token_budget} for {s.name}" + (f" = {s.budget_help}" if s.budget_help else "")
                    for s in policies())
    return f"token budget of one micro-batch (default: the policy's: {per})".replace("%", "%%")


@dataclass
class EngineArgs:
    """The engine's arguments: `LLM(...)`'s keywords, the engine flags of every command. Fields without a flag
    are keywords only. `knobs`: the chosen policy's knobs (and any other policy's) by name."""

    model: str | None = option(
        EngineConfig.model, "HF folder (config.json + safetensors), .gguf file, or random:NAME (random weights of "
                            "a published config for throughput benchmarks: qwen2.5-0.5b, llama-3.2-1b); default: "
                            "bundled SmolLM2-135M-Instruct", "--model")
    tokenizer: str | None = option(
        EngineConfig.tokenizer, "a folder whose tokenizer (and chat template) replaces the model's, as vLLM's "
                                "--tokenizer: for a .gguf file, the original model's folder (default: the "
                                "model's own)", "--tokenizer", metavar="FOLDER")
    generation_config: str = option(
        EngineConfig.generation_config, "auto = the model's generation_config.json sets the defaults of the "
                                        "sampling fields a request leaves out (temperature, top_p, top_k, min_p, "
                                        "repetition_penalty, max_new_tokens), as vLLM does; vllm = tdpipe's (vLLM's) "
                                        "own defaults (default: %(default)s)", "--generation-config",
        choices=list(GENERATION_CONFIGS))
    override_generation_config: dict[str, Any] | None = option(
        EngineConfig.override_generation_config, "JSON of generation_config.json keys (temperature, top_p, top_k, "
                                                 "min_p, repetition_penalty, max_new_tokens) over the model's file "
                                                 "with --generation-config auto, or alone with vllm (vLLM's flag)",
        "--override-generation-config", type=json_object, metavar="JSON")
    skip_tokenizer_init: bool = option(
        EngineConfig.skip_tokenizer_init, "load no tokenizer (vLLM's): prompts must be token ids and outputs "
                                          "have no text, as RL rollouts that tokenize themselves run; offline "
                                          "only (default: off)", "--skip-tokenizer-init", action="bool")
    dtype: str = option(EngineConfig.dtype, "auto = the device's: on CPU bfloat16 where the CPU has bf16 "
                                            "instructions, else float32; on CUDA bfloat16 (default: %(default)s)",
                        "--dtype", choices=["auto", "bfloat16", "float32"])
    quantization: str = option(EngineConfig.quantization,
                               "how the linear layers run: none = in --dtype (bf16 weights prepacked for oneDNN "
                               "on CPU; a quantised GGUF or AWQ checkpoint dequantised); w8a8 = int8 weights per "
                               "output channel, quantised at load, and int8 activations per token, both rotated "
                               "by Hadamard blocks of 64, int32 accumulation (CPU only; the lm_head too, in "
                               "oneDNN's int8 GEMM; 8-bit blocks without VNNI); gguf = a GGUF file's "
                               "quantised weights kept packed (4-bit as 4-bit) and multiplied against int8 "
                               "activations per block of 32 (CPU); awq = an AWQ folder's 4-bit weights kept "
                               "packed, the same way (CPU); auto = gguf for a --model .gguf file with quantised "
                               "tensors and awq for an AWQ folder, run in bf16 on CPU, else none "
                               "(docs/quantization.md) (default: %(default)s)",
                               "--quantization", "-q", choices=list(QUANTIZATIONS))
    device: str = option(ParallelConfig.device, "where the model runs: auto = cuda where torch sees a CUDA device, "
                                                "else cpu. The cuda path ran on one H200 (docs/gpu.md); tensor "
                                                "parallelism on cuda has not yet run on a GPU, nor has NCCL "
                                                "between stage GPUs (default: %(default)s)",
                         "--device", choices=list(DEVICES))
    seed: int = option(EngineConfig.seed, "engine seed for unseeded random sampling (default: %(default)s)",
                       "--seed", type=int)
    max_num_seqs: int = option(SchedulerConfig.max_num_seqs, "most sequences in one batch (default: %(default)s)",
                               "--max-num-seqs", type=int)
    max_model_len: int | None = option(SchedulerConfig.max_model_len, "prompt + output limit (default: 0 = the "
                                                                      "model's)", "--max-model-len", type=int)
    block_size: int = option(CacheConfig.block_size, "tokens per KV block (PagedAttention; default: %(default)s)",
                             "--block-size", type=int)
    kv_cache_memory: int | float | None = option(
        CacheConfig.kv_cache_memory, "KV cache budget: bytes (e.g. 2GiB) or a fraction of available memory (e.g. "
                                     "0.3); default min(4 GiB, 40%%)", "--kv-cache-memory", type=parse_memory)
    kv_cache_dtype: str = option(
        CacheConfig.kv_cache_dtype, "how the KV cache stores keys and values: auto = the run's dtype; int8 = one byte "
                                    "per element and a float32 scale per token and kv head, half the bytes "
                                    "attention reads and nearly twice the tokens per --kv-cache-memory (cpu only; "
                                    "docs/quantization.md) (default: %(default)s)",
        "--kv-cache-dtype", choices=list(KV_CACHE_DTYPES))
    gpu_memory_utilization: float = option(
        CacheConfig.gpu_memory_utilization, "cuda: the share of the GPU's total memory the engine may use, weights "
                                            "and KV cache included (vLLM's meaning); the KV cache gets what the "
                                            "weights and other processes leave of it. Ignored on cpu "
                                            "(default: %(default)s)", "--gpu-memory-utilization", type=float)
    num_kv_blocks: int | None = option(CacheConfig.num_blocks, "exact number of KV blocks (overrides the budget)",
                                       "--num-kv-blocks", type=int)
    enable_prefix_caching: bool = option(
        CacheConfig.enable_prefix_caching, "automatic prefix caching: a request reuses the KV of the longest prefix "
                                           "of full blocks an earlier request computed, and prefills only the rest "
                                           "(default: on)", "--enable-prefix-caching", action="bool")
    # the scheduler's part (also `tdpipe simulate`'s); the registered policies' knob flags follow it
    max_num_batched_tokens: int | None = option(SchedulerConfig.max_num_batched_tokens, _budget_help,
                                                "--max-num-batched-tokens", type=int, group="scheduler")
    scheduler: str = option(SchedulerConfig.policy, _policy_help, "--scheduler", choices=policy_names,
                            group="scheduler")
    predictor: str = option(
        SchedulerConfig.predictor, "td-pipe: output-length predictor for Algorithm 1 (§3.3): 'oracle' = max_tokens "
                                   "(the true length under ignore_eos), 'constant' = mean of the outputs recorded so "
                                   "far, 'constant:N', a FILE from `tdpipe predictor train` (BERT bucket classifier, "
                                   "§4.4.1), or 'auto' = oracle for ignore_eos requests, else the learned predictor "
                                   "shipped for the model if there is one, else constant (default: %(default)s)",
        "--predictor", group="scheduler")
    profile_cache: bool = option(
        SchedulerConfig.profile_cache, "measure at start-up even where a cached measurement exists: td-pipe's step "
                                       "costs for the intensity switch (Eq. 1-2) and, at pp > 1, the stage costs the "
                                       "layer partition balances (cached in $TDPIPE_CACHE/profiles, default "
                                       "~/.cache/tdpipe/profiles)", "--no-profile-cache", action="negate",
        group="scheduler")
    num_threads: int | None = option(EngineConfig.num_threads, "torch threads of the engine process (default: all "
                                                               "cores with --pp 1, else 1)", "--threads", type=int)
    # P x T (TD-Pipe §3.2, SiPipe's P(i,j)): one name, pipeline_parallel_size, from the flag to the stages
    pipeline_parallel_size: int = option(
        ParallelConfig.pipeline_parallel_size, "P: pipeline stages, each holding a contiguous slice of layers and "
                                               "their KV cache; the engine keeps up to P micro-batches in flight "
                                               "(default: %(default)s)",
        "--pp", "--pipeline-parallel-size", type=int, group="parallel")
    pipeline_depth: int | None = option(
        SchedulerConfig.pipeline_depth, "micro-batches the engine keeps in flight (default: P, one per stage). "
                                        "P + 1 gives the engine one micro-batch's compute time to sample and "
                                        "schedule the next step of the batch the last stage just returned, so "
                                        "that time stops stalling the first stage (the pipeline bubble, "
                                        "TD-Pipe §2.2); the running requests are split over this many "
                                        "micro-batches", "--pipeline-depth", type=int, group="parallel")
    tensor_parallel_size: int = option(
        ParallelConfig.tensor_parallel_size, "T: worker processes per stage, Megatron-style (q/k/v and gate/up "
                                             "split by column, o and down by row with one all-reduce each per layer, "
                                             "vocabulary-parallel embedding and lm_head, KV cache split by KV heads); "
                                             "P x T workers in all (default: %(default)s)",
        "--tp", "--tensor-parallel-size", type=int, group="parallel")
    data_parallel_size: int = option(
        ParallelConfig.data_parallel_size, "engine replicas on this machine, each with its own engine core (and "
                                           "stages) pinned to its own share of the cores; a request goes to the "
                                           "replica with the least outstanding work (default: %(default)s)",
        "--dp", "--data-parallel-size", type=int, group="parallel")
    disaggregation: str = option(
        ParallelConfig.disaggregation, "none = prefill and decode share every worker (the --scheduler decides how); "
                                       "pd = disaggregated in space (DistServe): --prefill-workers instances compute "
                                       "prompts and their first token, then ship the KV blocks through shared "
                                       "memory to --decode-workers instances that decode continuously; each "
                                       "instance is one worker process with the whole model, its own KV cache and "
                                       "its own cores (cpu only so far; needs --pp 1 --tp 1 --dp 1 and the "
                                       "default --scheduler; docs/disaggregation.md) (default: %(default)s)",
        "--disaggregation", choices=list(DISAGGREGATIONS), group="parallel")
    prefill_workers: int = option(
        ParallelConfig.prefill_workers, "with --disaggregation pd: prefill instances; a request goes to the least "
                                        "loaded one (default: %(default)s)", "--prefill-workers", type=int,
        group="parallel")
    decode_workers: int = option(
        ParallelConfig.decode_workers, "with --disaggregation pd: decode instances; a prefilled request goes to the "
                                       "first one with free KV blocks (default: %(default)s)", "--decode-workers",
        type=int, group="parallel")
    kv_transfer_blocks: int | None = option(
        ParallelConfig.kv_transfer_blocks, "with --disaggregation pd: KV blocks the shared staging area between the "
                                           "sides holds (a prompt is admitted for prefill only with room for all "
                                           "its blocks); default: a quarter of one instance's KV cache, at least "
                                           "one --max-model-len prompt", "--kv-transfer-blocks", type=int,
        group="parallel")
    layer_partition: list[int] | None = option(
        ParallelConfig.layer_partition, "layers per stage, comma-separated (e.g. 18,12); default: balanced by cost, "
                                        "counting the embedding on the first stage and norm + lm_head on the last",
        "--layer-partition", type=parse_partition, group="parallel")
    lm_head_split: float | None = option(
        ParallelConfig.lm_head_split, "with --pp > 1 and --tp 1: compute this share of the lm_head's vocabulary on "
                                      "the first stage (the last sends it the normalised rows), so the stages stay "
                                      "balanced in decode (heavy head) and in prefill (light head); the layer split "
                                      "is balanced with it. 0: the whole head on the last stage; auto: the share "
                                      "(and layers) with the least modelled decode + prefill time from the costs "
                                      "measured at start-up, 0 unless it saves over 1%% (default: auto)",
        "--lm-head-split", type=parse_head_split, metavar="F|auto", group="parallel")
    threads_per_stage: int | None = option(
        ParallelConfig.threads_per_stage, "torch threads in each worker process (default: the cores split evenly "
                                          "between the P x T workers)", "--threads-per-stage", type=int,
        group="parallel")
    trace: str | None = option(
        EngineConfig.trace, "write the run's timeline (per stage and micro-batch: compute, input wait, send, shape; "
                            "KV usage) as JSON; draw it with `tdpipe plot timeline FILE`", "--trace", metavar="FILE",
        group="parallel")
    record_history: str | None = option(
        EngineConfig.record_history, "append every finished request (prompt text, prompt and output token counts, "
                                     "finish reason, sampling params, model) to this JSONL file: the history "
                                     "`tdpipe predictor train` learns output lengths from", "--record-history",
        metavar="FILE", group="")
    enforce_eager: bool = option(
        EngineConfig.enforce_eager, "cuda: run every step eagerly instead of replaying decode steps as CUDA "
                                    "graphs; cpu runs eagerly anyway. CUDA graphs ran on one H200 "
                                    "(default: off)", "--enforce-eager", action="bool")
    cuda_graph_sizes: list[int] | None = option(
        EngineConfig.cuda_graph_sizes, "cuda: decode batch sizes captured as CUDA graphs, comma-separated; a "
                                       "decode batch runs padded to the next one, a larger one or a prefill "
                                       "eagerly (default: 1,2,4 and every multiple of 8 up to --max-num-seqs, "
                                       "at most 256)", "--cuda-graph-sizes", type=parse_graph_sizes,
        metavar="N,N,...")
    sampling_device: str = option(
        EngineConfig.sampling_device, "who samples: engine = the engine process from the logits the last stage "
                                      "sends (SiPipe §5.1; the last stage sends argmax ids when every row is "
                                      "greedy); stage = the last stage also samples plain-temperature rows (no "
                                      "top-k/top-p/min-p, penalties, logprobs or seed) on its device and sends "
                                      "ids; auto = stage on cuda, engine on cpu (default: %(default)s)",
        "--sampling-device", choices=list(SAMPLING_DEVICES))
    # keywords only
    collect_trace: bool = option(EngineConfig.collect_trace, "keep the timeline for LLM.trace() without writing it "
                                                             "(it costs memory)")
    knobs: dict[str, Any] = field(default_factory=dict)  # policy knobs by name: throttle_T, future_points, ...

    # -- LLM(...) keywords ---------------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, **kw: Any) -> "EngineArgs":
        """From `LLM(...)`-style keywords: the fields, and any registered policy's knobs; vLLM's arguments that
        mean nothing here are dropped with a warning (tdpipe/ignored_args.py); anything else is a TypeError
        naming it (and the closest known name)."""
        kw = drop_ignored(kw)
        names = {f.name for f in dataclasses.fields(cls)} - {"knobs"}
        owners = knob_owners()
        for k in kw:
            if k not in names and k not in owners:
                near = difflib.get_close_matches(k, sorted(names | set(owners)), n=1)
                raise TypeError(f"unexpected engine argument {k!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
        return cls(**{k: v for k, v in kw.items() if k in names}, knobs={k: v for k, v in kw.items() if k in owners})

    def to_kwargs(self) -> dict[str, Any]:
        """The keywords the command line gives (flagged fields and knobs): LLM(**args.to_kwargs()) rebuilds it."""
        return {f.name: getattr(self, f.name) for f in flagged(type(self))} | self.knobs

    def scheduler_kwargs(self) -> dict[str, Any]:
        """The scheduler's part of the keywords (what `tdpipe simulate` takes from the engine's flags)."""
        return {f.name: getattr(self, f.name) for f in flagged(type(self)) if f.metadata["group"] == "scheduler"} \
            | self.knobs

    # -- the command line ----------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        """The engine flags: group "engine" (the scheduler's part and the policies' knobs inside it), group
        "parallelism", and --record-history among the command's own options."""
        engine = p.add_argument_group("engine")
        groups = {"engine": engine, "": p,
                  "parallel": p.add_argument_group("parallelism: P pipeline stages x T tensor-parallel ranks "
                                                   "(TD-Pipe §3.2, SiPipe P(i,j))")}
        scheduler_done = False
        for f in flagged(cls):
            group = f.metadata["group"]
            if group == "scheduler":
                if not scheduler_done:
                    cls.add_scheduler_cli_args(engine)
                    scheduler_done = True
                continue
            add_flag(groups[group], f)
        add_ignored_flags(p)

    @classmethod
    def add_scheduler_cli_args(cls, g: argparse._ActionsContainer) -> None:
        """The batching policy, its shared settings and every registered policy's knobs (`tdpipe simulate`
        takes these alone)."""
        for f in flagged(cls):
            if f.metadata["group"] == "scheduler":
                add_flag(g, f)
        for spec in policies():
            if spec.knobs is not None:
                add_flags(g, spec.knobs)

    @classmethod
    def from_cli(cls, a: argparse.Namespace) -> "EngineArgs":
        """From parsed flags (those this command has; the rest keep their defaults)."""
        warn_ignored_flags(a)
        knobs = {k: getattr(a, k) for k in knob_owners() if hasattr(a, k)}
        return cls(**from_namespace(cls, a), knobs=knobs)

    # -- the engine ----------------------------------------------------------------------------------------
    def scheduler_config(self) -> SchedulerConfig:
        """The configured SchedulerConfig: shared limits, and the chosen policy's knobs (a knob of another
        policy is checked too, so a bad value fails whichever policy runs, but not used)."""
        spec = get_policy(self.scheduler)  # ValueError naming 'scheduler' and the registered names
        check_predictor_spec(self.predictor)  # ValueError naming 'predictor', before the model loads
        given: dict[str, dict[str, Any]] = {}
        owners = knob_owners()
        for k, v in self.knobs.items():
            if k not in owners:
                raise TypeError(f"unexpected engine argument {k!r}")
            given.setdefault(owners[k].name, {})[k] = v
        made = {name: get_policy(name).make_knobs(values) for name, values in given.items()}
        sched = SchedulerConfig(policy=self.scheduler, max_num_seqs=self.max_num_seqs,
                                max_num_batched_tokens=self.max_num_batched_tokens,
                                max_model_len=self.max_model_len or 0,
                                pipeline_depth=self.pipeline_depth,  # None: the engine builder takes pp
                                predictor=self.predictor, profile_cache=self.profile_cache,
                                knobs=made.get(spec.name))
        return spec.configure(sched)

    def create_engine_config(self) -> EngineConfig:
        """The EngineConfig the engine consumes, every part validated (a bad value fails here, naming its field,
        before any model loads; so does a device this machine lacks: --device cuda without CUDA)."""
        check_device(self.device)  # DeviceUnavailable, one line; the engine builder resolves auto
        return EngineConfig(
            model=self.model, tokenizer=self.tokenizer, skip_tokenizer_init=self.skip_tokenizer_init,
            generation_config=self.generation_config, override_generation_config=self.override_generation_config,
            dtype=self.dtype, quantization=self.quantization, seed=self.seed,
            num_threads=self.num_threads, trace=self.trace,
            record_history=self.record_history, collect_trace=self.collect_trace,
            enforce_eager=self.enforce_eager, cuda_graph_sizes=self.cuda_graph_sizes,
            sampling_device=self.sampling_device,
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                              num_blocks=self.num_kv_blocks, enable_prefix_caching=self.enable_prefix_caching,
                              kv_cache_dtype=self.kv_cache_dtype,
                              gpu_memory_utilization=self.gpu_memory_utilization),
            scheduler=self.scheduler_config(),
            parallel=ParallelConfig(pipeline_parallel_size=self.pipeline_parallel_size,
                                    tensor_parallel_size=self.tensor_parallel_size,
                                    layer_partition=self.layer_partition, lm_head_split=self.lm_head_split,
                                    threads_per_stage=self.threads_per_stage, device=self.device,
                                    data_parallel_size=self.data_parallel_size,
                                    disaggregation=self.disaggregation, prefill_workers=self.prefill_workers,
                                    decode_workers=self.decode_workers,
                                    kv_transfer_blocks=self.kv_transfer_blocks))


__all__ = ["EngineArgs", "parse_graph_sizes", "parse_head_split", "parse_memory", "parse_partition"]
