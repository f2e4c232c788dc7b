"""Configuration dataclasses, validated on construction so a bad value fails early and names its field."""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Any

from tdpipe import families

GiB = 1 << 30
DEVICES = ("auto", "cpu", "cuda")  # --device; tdpipe/platforms resolves auto and builds the platforms
SAMPLING_DEVICES = ("auto", "stage", "engine")  # --sampling-device (tdpipe/sampling/stage_rows.py)
GENERATION_CONFIGS = ("auto", "vllm")  # --generation-config (tdpipe/sampling/defaults.py)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


KV_CACHE_DTYPES = ("auto", "int8")  # --kv-cache-dtype: auto = the run's dtype; int8 (model/kv_quant.py)
KV_SCALE_BYTES = 4  # an int8 cache row ends in its float32 scale


def int8_kv_row_width(head_dim: int) -> int:
    """Bytes of one int8 cache row: head_dim int8 values padded to 4 bytes, then the row's float32 scale."""
    return -(-head_dim // KV_SCALE_BYTES) * KV_SCALE_BYTES + KV_SCALE_BYTES


@dataclass
class ModelConfig:
    """The decoder's shape, read from a Hugging Face config.json: Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3
    (text), Phi-3 and Granite (tdpipe/families.py)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool = False  # o_proj's bias (Llama, Qwen3, Gemma 3 with attention_bias)
    mlp_bias: bool = False  # gate/up/down biases (Llama with mlp_bias)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # per layer: None = global attention, W = a sliding window of the last W keys (the query itself included,
    # transformers' meaning); empty: all global, filled to num_layers on construction
    layer_windows: list[int | None] = field(default_factory=list)
    # how the linears run (model/quantization.py): set by the engine from --quantization, not by config.json
    quantization: str = "none"
    gguf_file: str = ""  # quantization "gguf": the file whose quantised blocks the linears keep (resolved)
    # how the KV cache stores keys and values (model/kv_quant.py): set by the engine from --kv-cache-dtype
    kv_cache_dtype: str = "auto"

    SUPPORTED = tuple(sorted(families.FAMILIES))  # Hugging Face architectures names

    # what sets the other families apart from Llama (tdpipe/families.py fills them from config.json)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rope (Qwen3, Gemma 3)
    norm: str = "rms"  # "rms": w * x (Llama); "gemma": x * (1 + w), multiplied in float32 (Gemma 3)
    sandwich_norms: bool = False  # norms on the attention output and around the MLP (Gemma 2/3)
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_pytorch_tanh
    embed_scale: float | None = None  # embeddings times this, rounded to their dtype (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    final_logit_softcap: float | None = None  # logits = c * tanh(logits / c) when set
    attn_softcap: float | None = None  # attention scores = c * tanh(scores / c) before the mask (Gemma 2)
    residual_scale: float = 1.0  # each attention and MLP output times this before it joins the residual (Granite)
    logits_scale: float = 1.0  # the logits divided by this (Granite's logits_scaling)
    local_rope_theta: float | None = None  # rope base of the windowed layers; None: rope_theta (Gemma 3: 10k)
    partial_rotary_factor: float = 1.0  # rope on the first head_dim * factor dims only (Phi-3/4)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """The decoder of a config.json of any supported family (tdpipe/families.py); an unsupported
        architecture or setting is one error naming it."""
        arch, fam, hf = families.family_of(hf)
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        act = fam.act_aliases.get(act, act)
        _check(act in families.ACTIVATIONS, f"{arch}: hidden activation {act!r} is not supported; supported: "
                                            f"{', '.join(families.ACTIVATIONS)}")
        attn_softcap = hf.get("attn_logit_softcapping")
        _check(attn_softcap is None or (isinstance(attn_softcap, (int, float)) and attn_softcap > 0),
               f"{arch}: attn_logit_softcapping must be a positive number or null, got {attn_softcap!r}")
        _check(not hf.get("use_bidirectional_attention"), f"{arch}: use_bidirectional_attention is not supported")
        theta, scaling = families.rope_settings(hf)
        hidden, layers = hf["hidden_size"], hf["num_hidden_layers"]
        local_theta = families.rope_settings(hf, local=True)[0] if fam.local_rope else None
        scalar = hf.get("query_pre_attn_scalar")
        mult = {k: float(hf.get(k, 1.0)) for k in ("embedding_multiplier", "attention_multiplier",
                                                   "residual_multiplier", "logits_scaling")} \
            if fam.multipliers else {}
        _check(all(v > 0 for v in mult.values()), f"{arch}: multipliers must be positive, got {mult}")
        embed_scale = hidden ** 0.5 if fam.embed_scale else mult.get("embedding_multiplier")
        attn_scale = None if scalar is None else float(scalar) ** -0.5
        qkv_bias, o_bias, mlp_bias = families.biases(fam, hf)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            layer_windows=families.layer_windows(fam, hf, layers),
            qk_norm=fam.qk_norm,
            norm=fam.norm,
            sandwich_norms=fam.sandwich_norms,
            hidden_act=act,
            embed_scale=None if embed_scale == 1.0 else embed_scale,
            attn_scale=mult.get("attention_multiplier", attn_scale),
            residual_scale=mult.get("residual_multiplier", 1.0),
            logits_scale=mult.get("logits_scaling", 1.0),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            attn_softcap=None if attn_softcap is None else float(attn_softcap),
            local_rope_theta=local_theta,
            partial_rotary_factor=families.partial_rotary_factor(hf),
        )

    def __post_init__(self) -> None:
        _check(self.num_heads % self.num_kv_heads == 0,
               f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})")
        if not self.layer_windows:
            self.layer_windows = [None] * self.num_layers
        _check(len(self.layer_windows) == self.num_layers,
               f"layer_windows has {len(self.layer_windows)} entries; the model has {self.num_layers} layers")
        _check(all(w is None or (isinstance(w, int) and w >= 1) for w in self.layer_windows),
               f"layer_windows entries must be None or an integer >= 1, got {self.layer_windows}")
        _check(self.norm in ("rms", "gemma"), f"norm must be rms or gemma, got {self.norm!r}")
        rot = int(self.head_dim * self.partial_rotary_factor)
        _check(0 < rot <= self.head_dim and rot % 2 == 0,
               f"partial_rotary_factor {self.partial_rotary_factor} leaves {rot} of {self.head_dim} head dims "
               "to rotate; it needs an even number >= 2")

    @property
    def rotary_dim(self) -> int:
        """The head dims rope turns (all but with a partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def sliding_window(self) -> int | None:
        """The largest window of the local layers; None when every layer attends globally."""
        return max((w for w in self.layer_windows if w is not None), default=None)

    @property
    def has_local_layers(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    def params_per_token_flops(self) -> int:
        """Dense FLOPs per token through all decoder layers (2 x weights), without attention scores or lm_head."""
        h, i = self.hidden_size, self.intermediate_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
        return 2 * per_layer * self.num_layers

    def layer_bias_params(self) -> int:
        """The biases of one decoder layer: q/k/v, o_proj and the MLP's, where the model has them."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (((q + 2 * kv) if self.qkv_bias else 0) + (h if self.o_bias else 0)
                + ((2 * i + h) if self.mlp_bias else 0))

    def num_params(self) -> int:
        """Weights of the whole model: decoder layers (with their biases where the model has them), norms,
        the embedding and an untied lm_head."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        norms = (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + norms + self.layer_bias_params()
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return per_layer * self.num_layers + embed + h

    def kv_row_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one token's key (or value) in one kv head: head_dim elements of the run's dtype, or with an
        int8 cache head_dim bytes and the row's scale (int8_kv_row_width)."""
        if self.kv_cache_dtype == "int8":
            return int8_kv_row_width(self.head_dim)
        return self.head_dim * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.kv_row_bytes(dtype_bytes)


@dataclass
class CacheConfig:
    """Paged KV cache: block size in tokens and the memory budget that sets the number of blocks."""

    block_size: int = 16
    # bytes, a fraction of available memory, or None: the platform's default (CPU: min(4 GiB, 40%); CUDA:
    # what gpu_memory_utilization leaves; tdpipe/platforms/)
    kv_cache_memory: int | float | None = None
    num_blocks: int | None = None  # overrides kv_cache_memory when set (tests)
    # automatic prefix caching (PagedAttention's prefix sharing, lecture 001 §3.3; on by default, as in vLLM):
    # full blocks are named by a hash of their prefix and reused by later requests (core/prefix_cache.py)
    enable_prefix_caching: bool = True
    # CUDA: the share of the device's total memory this engine may use, weights and KV cache included (vLLM's
    # meaning; tdpipe/platforms/cuda.py); ignored on CPU
    gpu_memory_utilization: float = 0.9
    # auto: keys and values in the run's dtype; int8: one byte per element and a float32 scale per token and kv
    # head (model/kv_quant.py), half the bytes attention reads and nearly twice the tokens a budget holds (CPU)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
               + (" (fp8 caches are not built; int8 is the 8-bit cache)" if str(self.kv_cache_dtype).startswith("fp8")
                  else ""))
        _check(isinstance(self.block_size, int) and self.block_size >= 1,
               f"block_size must be an integer >= 1, got {self.block_size!r}")
        m = self.kv_cache_memory
        if isinstance(m, float):
            _check(0.0 < m <= 0.95, f"kv_cache_memory as a fraction must be in (0, 0.95], got {m}")
        elif m is not None:
            _check(isinstance(m, int) and m > 0, f"kv_cache_memory in bytes must be a positive integer, got {m!r}")
        _check(isinstance(self.enable_prefix_caching, bool),
               f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.num_blocks is not None:
            _check(self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")
        u = self.gpu_memory_utilization
        _check(isinstance(u, (int, float)) and not isinstance(u, bool) and 0.0 < u <= 1.0,
               f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")


@dataclass
class SchedulerConfig:
    """Batching limits shared by every policy. A policy's own knobs travel in `knobs`, an object of the dataclass
    its registry spec declares (core/scheduler/registry.py); the spec fills it in, and the token budget the
    user left out, when the policy is resolved (PolicySpec.configure), so this module knows no policy."""

    policy: str = "separate"  # a registered policy (core/scheduler/registry.py)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: the policy's default (its PolicySpec.default_token_budget)
    max_model_len: int = 0  # 0: the model's max_position_embeddings (set by EngineConfig)
    # micro-batches the engine keeps in flight; None: pipeline_parallel_size (one per stage). One more than the
    # stages leaves the engine a micro-batch's compute time to sample and schedule the next step of the batch
    # that just left the last stage, so its latency stops being the first stage's bubble (pp > 1)
    pipeline_depth: int | None = None
    # output lengths for policies that ask for them (PolicySpec.needs_predictor; TD-Pipe's Algorithm 1):
    # auto | oracle | constant[:N] | a file (tdpipe/predictor/factory.py)
    predictor: str = "auto"
    # reuse start-up measurements: the step-cost profile (PolicySpec.needs_step_costs), pp > 1's stage costs
    profile_cache: bool = True
    knobs: Any = None  # the policy's knob object; None or a dict: PolicySpec.configure makes it

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None:
            _check(self.max_num_batched_tokens >= 1,
                   f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        d = self.pipeline_depth
        _check(d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 1),
               f"pipeline_depth must be an integer >= 1 or None (the pipeline stages), got {d!r}")
        _check(isinstance(self.predictor, str), f"predictor must be a string, got {self.predictor!r}")


@dataclass
class ParallelConfig:
    """The P x T layout (TD-Pipe §3.2; SiPipe's P(i,j), §1): P pipeline stages, each a slice of layers run by a
    group of T tensor-parallel ranks (Megatron-style sharding inside the stage)."""

    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1  # T: ranks per stage, vLLM's --tensor-parallel-size
    layer_partition: list[int] | None = None  # layers per stage, e.g. [18, 12]; None: balance by cost
    threads_per_stage: int | None = None  # None: the cores split evenly between stages
    # share of the lm_head's vocabulary computed on the first stage (T = 1, P > 1): the last stage sends it
    # the normalised rows; 0 keeps the whole head on the last stage; None (auto) picks it with the layers
    # from the measured stage costs (tdpipe/worker/partition.py: choose_head_split)
    lm_head_split: float | None = None
    # auto | cpu | cuda; auto: cuda where torch sees a CUDA device (tdpipe/platforms/resolve_device). The CUDA
    # path ran on one H200 (docs/gpu.md); NCCL between stage GPUs and TP on CUDA have not yet run
    device: str = "auto"
    # engine replicas on this machine, each on its own cores (core/data_parallel.py); vLLM's --data-parallel-size
    data_parallel_size: int = 1
    # prefill/decode disaggregation in space (DistServe; docs/disaggregation.md): "none" (colocated) or "pd":
    # prefill_workers instances compute prompts and their first token and ship the KV to decode_workers
    # instances that decode continuously, each instance a worker process on its own cores
    disaggregation: str = "none"
    prefill_workers: int = 1
    decode_workers: int = 1
    kv_transfer_blocks: int | None = None  # staging slots (KV blocks) between the two sides; None: sized by the builder

    def __post_init__(self) -> None:
        self._check_disaggregation()
        dp = self.data_parallel_size
        _check(isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1,
               f"data_parallel_size must be an integer >= 1, got {dp!r}")
        pp = self.pipeline_parallel_size
        _check(isinstance(pp, int) and pp >= 1, f"pipeline_parallel_size must be an integer >= 1, got {pp!r}")
        tp = self.tensor_parallel_size
        _check(isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1,
               f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if self.layer_partition is not None:
            lp = self.layer_partition
            _check(len(lp) == pp, f"layer_partition {lp} has {len(lp)} entries; pipeline_parallel_size is {pp}")
            _check(all(isinstance(n, int) and n >= 1 for n in lp),
                   f"layer_partition {lp}: every stage needs at least one layer")
        if self.threads_per_stage is not None:
            _check(self.threads_per_stage >= 1, f"threads_per_stage must be >= 1, got {self.threads_per_stage}")
        f = self.lm_head_split
        _check(f is None or (isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 <= f < 1.0),
               f"lm_head_split must be a fraction in [0, 1) or None (auto), got {f!r}")
        if f:
            _check(pp > 1 and tp == 1, f"lm_head_split {f} needs pipeline_parallel_size > 1 and "
                                       f"tensor_parallel_size 1 (got {pp} and {tp}); with tensor parallelism "
                                       "the last stage's ranks split the head already")
        _check(self.device in DEVICES, f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")

    def _check_disaggregation(self) -> None:
        _check(self.disaggregation in DISAGGREGATIONS,
               f"disaggregation must be one of {', '.join(DISAGGREGATIONS)}, got {self.disaggregation!r}")
        for name in ("prefill_workers", "decode_workers"):
            n = getattr(self, name)
            _check(isinstance(n, int) and not isinstance(n, bool) and n >= 1, f"{name} must be an integer >= 1, got {n!r}")
            _check(n == 1 or self.disaggregation == "pd", f"{name} is {n}: it needs disaggregation 'pd'")
        k = self.kv_transfer_blocks
        _check(k is None or (isinstance(k, int) and not isinstance(k, bool) and k >= 1),
               f"kv_transfer_blocks must be an integer >= 1 or None, got {k!r}")
        if self.disaggregation == "pd":  # each instance runs the model whole, in one process
            for name in ("pipeline_parallel_size", "tensor_parallel_size", "data_parallel_size"):
                _check(getattr(self, name) == 1, f"{name} is {getattr(self, name)}: disaggregation 'pd' runs each "
                                                 f"instance as one worker with the whole model ({name} 1)")

    @property
    def world_size(self) -> int:
        """Worker processes: P stages x T ranks (the engine is one more)."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    def stage_threads(self) -> int:
        """Threads per worker rank: the cores split evenly between the P x T ranks."""
        return self.threads_per_stage or max(1, default_threads() // self.world_size)


DISAGGREGATIONS = ("none", "pd")  # --disaggregation (core/pd_parts.py)
# the generation_config.json keys that set sampling defaults (vLLM's get_diff_sampling_param reads these six)
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
QUANTIZATIONS = ("auto", "none", "w8a8", "gguf", "awq")  # --quantization: how the linears run (model/quantization.py)


@dataclass
class EngineConfig:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    tokenizer: str | None = None  # a folder whose tokenizer replaces the model's (vLLM's --tokenizer)
    skip_tokenizer_init: bool = False  # no tokenizer at all: token ids in, token ids out (vLLM's)
    # auto: the model's generation_config.json sets the sampling defaults (vLLM's); vllm: tdpipe's own
    generation_config: str = "auto"
    # vLLM's --override-generation-config: these generation_config.json keys over the file's (auto) or alone
    override_generation_config: dict[str, Any] | None = None
    dtype: str = "auto"  # auto | bfloat16 | float32
    quantization: str = "auto"  # one of QUANTIZATIONS (model/quantization.py)
    seed: int = 0
    num_threads: int | None = None  # None: all cores
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trace: str | None = None  # --trace FILE: per-stage, per-micro-batch timeline (JSON)
    record_history: str | None = None  # --record-history FILE: append each finished request (JSONL)
    # the timeline (KV usage, per micro-batch submit/result, per stage compute) is kept only when asked for
    # (collect_trace, or a --trace FILE) and then only its last trace_max_events entries per list: a server
    # runs for weeks
    collect_trace: bool = False
    trace_max_events: int = 1_000_000
    # decode steps as CUDA graphs of these batch sizes (None: 1, 2, 4 and every multiple of 8 up to
    # max_num_seqs, at most 256; tdpipe/worker/cuda_graph.py) unless enforce_eager; CUDA only
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    # who samples plain rows: auto | stage (the last stage, on its device) | engine (SiPipe §5.1's CPU
    # sampling); auto = stage on CUDA, engine on CPU (tdpipe/sampling/stage_rows.py)
    sampling_device: str = "auto"

    DTYPES = ("auto", "bfloat16", "bf16", "float32", "fp32")

    def __post_init__(self) -> None:
        _check(self.dtype in self.DTYPES, f"dtype must be one of {self.DTYPES}, got {self.dtype!r}")
        _check(self.quantization in QUANTIZATIONS,
               f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.num_threads is not None:
            _check(self.num_threads >= 1, f"num_threads must be >= 1, got {self.num_threads}")
        _check(self.trace_max_events >= 1, f"trace_max_events must be >= 1, got {self.trace_max_events}")
        if self.trace:
            self.collect_trace = True
        _check(isinstance(self.enforce_eager, bool), f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        sizes = self.cuda_graph_sizes
        _check(sizes is None or (isinstance(sizes, (list, tuple)) and len(sizes) > 0 and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)),
            f"cuda_graph_sizes must be None or a non-empty list of batch sizes >= 1, got {sizes!r}")
        _check(self.sampling_device in SAMPLING_DEVICES,
               f"sampling_device must be one of {', '.join(SAMPLING_DEVICES)}, got {self.sampling_device!r}")
        _check(self.generation_config in GENERATION_CONFIGS, f"generation_config must be one of "
               f"{', '.join(GENERATION_CONFIGS)}, got {self.generation_config!r}")
        over = self.override_generation_config
        _check(over is None or isinstance(over, dict), f"override_generation_config must be a dict or None, got "
                                                       f"{over!r}")
        unknown = sorted(set(over or {}) - set(GENERATION_SAMPLING_KEYS))
        _check(not unknown, f"override_generation_config: {', '.join(map(repr, unknown))} is not a sampling key "
                            f"of generation_config.json (known: {', '.join(GENERATION_SAMPLING_KEYS)})")
        _check(self.parallel.disaggregation == "none" or self.scheduler.policy == "separate",
               f"scheduler is {self.scheduler.policy!r}: disaggregation 'pd' schedules each side itself (whole "
               "prompts on the prefill instances, every running request on the decode instances); leave scheduler "
               "at 'separate'")


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); falls back to 8 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows; keys caches and labels benchmarks."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's first "flags" line, "Features" on Arm; empty where there is
    none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def cpu_supports_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_supports_vnni() -> bool:
    """int8 dot products in hardware (AVX-512 VNNI or AVX-VNNI): what makes torch._int_mm fast. Without it
    torch 2.13's _int_mm runs a slow loop: 1-4 GOP/s on an AVX2 EPYC, where float32 runs ~100 GFLOP/s."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


DEFAULT_KV_BYTES = 4 * GiB  # --kv-cache-memory unset, on CPU: min(4 GiB, DEFAULT_KV_FRACTION of available memory)
DEFAULT_KV_FRACTION = 0.4


def kv_budget(requested: int | float | None, available: int) -> int:
    """--kv-cache-memory on a host with `available` bytes free: bytes as given, a fraction of available,
    or None: min(4 GiB, 40% of available)."""
    if requested is None:
        return int(min(DEFAULT_KV_BYTES, DEFAULT_KV_FRACTION * available))
    if isinstance(requested, float):
        return int(requested * available)
    return int(requested)


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
