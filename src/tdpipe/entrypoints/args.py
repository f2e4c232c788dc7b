"""Command-line flags shared by every subcommand that builds an engine, and their mapping to LLM(...).

Every default is read from the config dataclasses (declared once there); the policies, their help and their
token budgets from the policy registry, so a new policy needs no change here."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from tdpipe.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tdpipe.core.scheduler.registry import policies, policy_names

# argparse dest -> (config dataclass, field) whose default the flag takes. Flags that invert a bool
# (--no-work-stealing) or pack two fields (--future-points) are derived below from the same fields.
FLAG_FIELDS: dict[str, tuple[type, str]] = {
    "model": (EngineConfig, "model"), "dtype": (EngineConfig, "dtype"), "seed": (EngineConfig, "seed"),
    "threads": (EngineConfig, "num_threads"), "trace": (EngineConfig, "trace"),
    "record_history": (EngineConfig, "record_history"),
    "block_size": (CacheConfig, "block_size"), "kv_cache_memory": (CacheConfig, "kv_cache_memory"),
    "num_kv_blocks": (CacheConfig, "num_blocks"), "enable_prefix_caching": (CacheConfig, "enable_prefix_caching"),
    "pp": (ParallelConfig, "pipeline_parallel_size"), "tp": (ParallelConfig, "tensor_parallel_size"),
    "layer_partition": (ParallelConfig, "layer_partition"), "lm_head_split": (ParallelConfig, "lm_head_split"),
    "threads_per_stage": (ParallelConfig, "threads_per_stage"),
    "scheduler": (SchedulerConfig, "policy"), "max_num_seqs": (SchedulerConfig, "max_num_seqs"),
    "max_num_batched_tokens": (SchedulerConfig, "max_num_batched_tokens"),
    "max_model_len": (SchedulerConfig, "max_model_len"),
    "throttle_T": (SchedulerConfig, "throttle_T"), "max_prefill_tokens": (SchedulerConfig, "max_prefill_tokens"),
    "min_prefill_tokens": (SchedulerConfig, "min_prefill_tokens"), "kv_thresh": (SchedulerConfig, "kv_thresh"),
    "switch_to_decode": (SchedulerConfig, "switch_to_decode"),
    "switch_to_prefill": (SchedulerConfig, "switch_to_prefill"), "predictor": (SchedulerConfig, "predictor"),
}


def field_default(cls: type, name: str) -> Any:
    """The default a config dataclass declares for `name` (its factory's value for a mutable one)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default")
    raise ValueError(f"{cls.__name__} has no field {name!r}")


def _d(dest: str) -> Any:
    return field_default(*FLAG_FIELDS[dest])


def future_points_default() -> str:
    return f"{field_default(SchedulerConfig, 'future_point_step')},{field_default(SchedulerConfig, 'future_point_max')}"


def _policy_help() -> str:
    helps = "; ".join(f"{s.name} = {s.help}" for s in policies()).replace("%", "%%")  # argparse formats help
    return "batching policy (default: %(default)s): " + helps


def _budget_help() -> str:
    per = "; ".join(f"{s.default_token_budget} for {s.name}" + (f" = {s.budget_help}" if s.budget_help else "")
                    for s in policies())
    return f"token budget of one micro-batch (default: the policy's: {per})".replace("%", "%%")


def _head_split(v: str) -> float | None:
    """'auto' (None) or a fraction in [0, 1) (ParallelConfig checks the range)."""
    if v.strip().lower() == "auto":
        return None
    try:
        return float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1) or 'auto', got {v!r}") from None


def _memory(v: str) -> int | float:
    """'0.3' is a fraction of available memory; '2GiB', '512MiB' or a plain integer are bytes."""
    s = v.strip()
    units = {"gib": 1 << 30, "gb": 10**9, "mib": 1 << 20, "mb": 10**6, "kib": 1 << 10}
    for u, m in units.items():
        if s.lower().endswith(u):
            return int(float(s[: -len(u)]) * m)
    if "." in s:
        return float(s)
    return int(s)


def _partition(v: str) -> list[int]:
    try:
        parts = [int(x) for x in v.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layer-partition {v!r}: expected comma-separated layer counts, "
                                         "e.g. 18,12") from None
    if any(n < 1 for n in parts):
        raise argparse.ArgumentTypeError(f"--layer-partition {v!r}: every stage needs at least one layer")
    return parts


def _future_points(v: str) -> tuple[int, int]:
    try:
        step, top = (int(x) for x in v.split(","))
    except ValueError:
        raise SystemExit(f"--future-points {v!r}: expected STEP,MAX, e.g. 32,1024") from None
    return step, top


def add_scheduler_args(g: argparse._ActionsContainer) -> None:
    """The batching policy and its knobs: shared by the real engine and `tdpipe simulate`."""
    g.add_argument("--max-num-batched-tokens", type=int, default=_d("max_num_batched_tokens"), help=_budget_help())
    g.add_argument("--scheduler", default=_d("scheduler"), choices=policy_names(), help=_policy_help())
    g.add_argument("--future-points", default=future_points_default(), metavar="STEP,MAX",
                   help="td-pipe: futurePoints, the decode steps where predicted KV usage is checked: every "
                        "STEP steps up to MAX (TD-Pipe §3.3, Algorithm 1; default: %(default)s)")
    g.add_argument("--switch-to-decode", default=_d("switch_to_decode"),
                   help="td-pipe: 'predict' (Approach 1, Algorithm 1) or 'kv-ratio:R', switch once KV usage "
                        "reaches R (the §4.4.1 ablation; default: %(default)s)")
    g.add_argument("--switch-to-prefill", default=_d("switch_to_prefill"),
                   help="td-pipe: 'intensity' (Approach 3, spatial < temporal intensity, Eq. 1-2), "
                        "'reachable-intensity' (Eq. 1's Peak taken at the decode batch a switch would reach, "
                        "running + admissible requests / pp, not at the profile's largest batch), or "
                        "'finish-ratio:R', switch once R of the phase's requests finished (§4.4.3 ablation; default: "
                        "%(default)s)")
    g.add_argument("--no-work-stealing", action="store_true",
                   help="td-pipe: turn off Approach 2, inter-batch work stealing (§3.4; §4.4.2 ablation)")
    g.add_argument("--predictor", default=_d("predictor"),
                   help="td-pipe: output-length predictor for Algorithm 1 (§3.3): 'oracle' = max_tokens (the true "
                        "length under ignore_eos), 'constant' = mean of the outputs recorded so far, "
                        "'constant:N', a FILE from `tdpipe predictor train` (BERT bucket classifier, §4.4.1), or "
                        "'auto' = oracle for ignore_eos requests, else the learned predictor shipped for the "
                        "model if there is one, else constant (default: %(default)s)")
    g.add_argument("--no-profile-cache", action="store_true",
                   help="td-pipe: measure the step costs for the intensity switch (Eq. 1-2) at start-up even if "
                        "a cached profile exists (cached in $TDPIPE_CACHE/profiles, default ~/.cache/tdpipe/profiles)")
    g.add_argument("--throttle-T", type=float, default=_d("throttle_T"),
                   help="throttle: #T, spread the waiting prefill tokens #WP over this many batches (Eq. 3; "
                        "default: %(default)s)")
    g.add_argument("--max-prefill-tokens", type=int, default=_d("max_prefill_tokens"),
                   help="throttle: #MaxP, most prefill tokens in a batch when the KV cache is empty (Eq. 3; "
                        "default: %(default)s)")
    g.add_argument("--min-prefill-tokens", type=int, default=_d("min_prefill_tokens"),
                   help="throttle: #MinP, fewest prefill tokens in a batch while prompts wait (Eq. 3; "
                        "default: %(default)s)")
    g.add_argument("--kv-thresh", type=float, default=_d("kv_thresh"),
                   help="throttle: KVthresh, no prefill while the free KV fraction is below it (Eq. 3; "
                        "default: %(default)s)")


def scheduler_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(max_num_batched_tokens=a.max_num_batched_tokens, scheduler=a.scheduler, throttle_T=a.throttle_T,
                max_prefill_tokens=a.max_prefill_tokens, min_prefill_tokens=a.min_prefill_tokens,
                kv_thresh=a.kv_thresh, future_points=_future_points(a.future_points),
                switch_to_decode=a.switch_to_decode, switch_to_prefill=a.switch_to_prefill,
                work_stealing=not a.no_work_stealing, predictor=a.predictor, profile_cache=not a.no_profile_cache)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=_d("model"),
                   help="HF folder (config.json + safetensors), .gguf file, or random:NAME (random weights of a "
                        "published config for throughput benchmarks: qwen2.5-0.5b, llama-3.2-1b); default: bundled "
                        "SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default=_d("dtype"), choices=["auto", "bfloat16", "float32"],
                   help="auto = bfloat16 where the CPU has bf16 instructions, else float32 (default: %(default)s)")
    g.add_argument("--seed", type=int, default=_d("seed"),
                   help="engine seed for unseeded random sampling (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=_d("max_num_seqs"),
                   help="most sequences in one batch (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=_d("max_model_len"),
                   help="prompt + output limit (default: 0 = the model's)")
    g.add_argument("--block-size", type=int, default=_d("block_size"),
                   help="tokens per KV block (PagedAttention; default: %(default)s)")
    g.add_argument("--kv-cache-memory", type=_memory, default=_d("kv_cache_memory"),
                   help="KV cache budget: bytes (e.g. 2GiB) or a fraction of available memory (e.g. 0.3); "
                        "default min(4 GiB, 40%%)")
    g.add_argument("--num-kv-blocks", type=int, default=_d("num_kv_blocks"),
                   help="exact number of KV blocks (overrides the budget)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_d("enable_prefix_caching"),
                   help="automatic prefix caching: a request reuses the KV of the longest prefix of full blocks "
                        "an earlier request computed, and prefills only the rest (default: on)")
    add_scheduler_args(g)
    g.add_argument("--threads", type=int, default=_d("threads"),
                   help="torch threads of the engine process (default: all cores with --pp 1, else 1)")
    g = p.add_argument_group("parallelism: P pipeline stages x T tensor-parallel ranks (TD-Pipe §3.2, SiPipe P(i,j))")
    g.add_argument("--pp", "--pipeline-parallel-size", dest="pp", type=int, default=_d("pp"),
                   help="P: pipeline stages, each holding a contiguous slice of layers and their KV cache; the "
                        "engine keeps up to P micro-batches in flight (default: %(default)s)")
    g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=_d("tp"),
                   help="T: worker processes per stage, Megatron-style (q/k/v and gate/up split by column, o and "
                        "down by row with one all-reduce each per layer, vocabulary-parallel embedding and "
                        "lm_head, KV cache split by KV heads); P x T workers in all (default: %(default)s)"),
    g.add_argument("--layer-partition", type=_partition, default=_d("layer_partition"),
                   help="layers per stage, comma-separated (e.g. 18,12); default: balanced by cost, counting "
                        "the embedding on the first stage and norm + lm_head on the last")
    g.add_argument("--lm-head-split", type=_head_split, default=_d("lm_head_split"), metavar="F|auto",
                   help="with --pp > 1 and --tp 1: compute this share of the lm_head's vocabulary on the first "
                        "stage (the last sends it the normalised rows), so the stages stay balanced in decode "
                        "(heavy head) and in prefill (light head); the layer split is balanced with it. 0: the "
                        "whole head on the last stage; auto: the share (and layers) with the least modelled "
                        "decode + prefill time from the costs measured at start-up, 0 unless it saves over 1%% "
                        "(default: auto)")
    g.add_argument("--threads-per-stage", type=int, default=_d("threads_per_stage"),
                   help="torch threads in each worker process (default: the cores split evenly between the P x T "
                        "workers)")
    g.add_argument("--trace", default=_d("trace"), metavar="FILE",
                   help="write the run's timeline (per stage and micro-batch: compute, input wait, send, shape; "
                        "KV usage) as JSON; draw it with `tdpipe plot timeline FILE`")
    p.add_argument("--record-history", default=_d("record_history"), metavar="FILE",
                   help="append every finished request (prompt text, prompt and output token counts, finish "
                        "reason, sampling params, model) to this JSONL file: the history `tdpipe predictor "
                        "train` learns output lengths from")


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(model=a.model, dtype=a.dtype, seed=a.seed, max_num_seqs=a.max_num_seqs,
                max_model_len=a.max_model_len, block_size=a.block_size, kv_cache_memory=a.kv_cache_memory,
                num_kv_blocks=a.num_kv_blocks, enable_prefix_caching=a.enable_prefix_caching,
                num_threads=a.threads, pipeline_parallel_size=a.pp, tensor_parallel_size=a.tp,
                layer_partition=a.layer_partition, lm_head_split=a.lm_head_split,
                threads_per_stage=a.threads_per_stage, trace=a.trace,
                record_history=a.record_history) | scheduler_kwargs(a)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128, samples: bool = True) -> None:
    """`samples`: also n, best_of and logprobs (tdpipe generate; the interactive chat shows one answer)."""
    g = p.add_argument_group("sampling")
    from tdpipe.sampling.params import SamplingParams

    def d(name: str) -> Any:
        return field_default(SamplingParams, name)

    # max_tokens and temperature are the command line's own: answers longer than the API's 16 tokens, and
    # greedy unless asked (SamplingParams keeps OpenAI's defaults for the library and the server)
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="most output tokens per request (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=d("top_p"), help="(default: %(default)s)")
    g.add_argument("--top-k", type=int, default=d("top_k"), help="-1 disables (default: %(default)s)")
    g.add_argument("--min-p", type=float, default=d("min_p"), help="(default: %(default)s)")
    g.add_argument("--repetition-penalty", type=float, default=d("repetition_penalty"), help="(default: %(default)s)")
    g.add_argument("--presence-penalty", type=float, default=d("presence_penalty"), help="(default: %(default)s)")
    g.add_argument("--frequency-penalty", type=float, default=d("frequency_penalty"), help="(default: %(default)s)")
    g.add_argument("--sampling-seed", type=int, default=d("seed"), help="per-request seed (reproducible sampling)")
    g.add_argument("--stop", action="append", default=d("stop"), help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS up to --max-tokens")
    if not samples:
        return
    g.add_argument("--n", type=int, default=d("n"),
                   help="answers per prompt; the prompt is prefilled once and its KV blocks shared (default: "
                        "%(default)s)")
    g.add_argument("--best-of", type=int, default=d("best_of"),
                   help="sample this many (>= --n) and keep the --n with the highest cumulative logprob")
    g.add_argument("--logprobs", type=int, default=d("logprobs"), metavar="K",
                   help="per output token: its logprob and rank and the top K (0-20), after penalties and "
                        "temperature")
    g.add_argument("--prompt-logprobs", type=int, default=d("prompt_logprobs"), metavar="K",
                   help="per prompt token: its logprob and rank and the top K (0-20); such prompts are "
                        "prefilled whole (no prefix-cache hit)")


def sampling_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                frequency_penalty=a.frequency_penalty, seed=a.sampling_seed, stop=a.stop, ignore_eos=a.ignore_eos,
                **{k: getattr(a, k) for k in ("n", "best_of", "logprobs", "prompt_logprobs") if hasattr(a, k)})
