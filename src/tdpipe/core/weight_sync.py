"""Weights and memory between generate calls, for RL and data-generation loops: `update_weights` (new
weights in place, vLLM's collective_rpc-based weight sync and SGLang's update_weights_from_disk), `sleep` /
`wake_up` (give the KV cache, and optionally the weights, back while a trainer runs).

All three need an idle engine (no unfinished request): the offline `LLM` runs them between generate calls,
so a request always finishes on the weights it started with. Every worker (each pipeline stage, each
tensor-parallel rank) does its own part through `Executor.collective_rpc`; no process starts or stops.
The prefix cache is emptied each time: no request may reuse KV computed by other weights (or lost in sleep).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tdpipe.core.engine import LLMEngine

WeightSource = str | os.PathLike | Iterable[tuple[str, torch.Tensor]]
# what new weights must share with the loaded model: the engine's KV cache, partition and tables depend on them
SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "o_bias",
                "mlp_bias")


def _idle(engine: LLMEngine, what: str) -> None:
    if engine.has_unfinished():
        raise RuntimeError(f"{what} needs an idle engine: {len(engine.requests)} request(s) are unfinished "
                           "(call it between generate() calls, or abort them first)")


def _paused(engine: LLMEngine, what: str) -> None:
    """Nothing in flight and no sequence holding KV (requests may wait: they hold nothing yet)."""
    if engine._inflight or engine.scheduler.running:
        raise RuntimeError(f"{what} needs an idle or paused engine: {len(engine.scheduler.running)} request(s) "
                           "are running (call it between generate() calls, or abort them first)")


def update_weights(engine: LLMEngine, source: WeightSource) -> int:
    """Load new weights: a checkpoint folder (every worker reads its own slices from disk), or (Hugging Face
    name, tensor) pairs in memory (pp = tp = 1: a pipeline's workers are other processes). Returns the new
    weight version, which every later RequestOutput carries. Requests waiting (none running or in flight:
    an idle engine, or one LLMEngine.pause() stopped) run on the new weights."""
    _paused(engine, "update_weights")
    if isinstance(source, (str, os.PathLike)):
        from tdpipe.config import ModelConfig
        from tdpipe.model.weights import check_model_folder

        folder = os.path.abspath(os.fspath(source))
        # one clear line for a missing or broken folder, before any worker loads (a trainer's checkpoint
        # need not carry the tokenizer)
        new = ModelConfig.from_hf(check_model_folder(folder, tokenizer=False))
        old = engine.model_config
        differ = [f for f in SHAPE_FIELDS if getattr(new, f) != getattr(old, f)]
        if differ:
            raise ValueError(f"update_weights: {folder} is a different model: its {', '.join(differ)} differ "
                             "from the loaded one's")
        payload: Any = folder
    else:
        if engine.executor.num_stages > 1 or engine.config.parallel.tensor_parallel_size > 1:
            raise ValueError("update_weights with tensors in memory runs at pipeline_parallel_size = "
                             "tensor_parallel_size = 1; save them and pass the checkpoint folder")
        payload = list(source)
    if "weights" in engine.asleep:
        raise RuntimeError("the engine is asleep: call wake_up() (or wake_up(tags=['weights']), which leaves "
                           "the KV cache asleep) before update_weights()")
    try:
        engine.executor.collective_rpc("update_weights", (payload,))
    finally:
        # no cached prefix was computed with these weights, nor with what a failed load restored (the
        # workers reload the last folder: ModelRunner.update_weights)
        _reset_page_tables(engine)
    engine.weight_version += 1
    return engine.weight_version


def _reset_page_tables(engine: LLMEngine) -> None:
    """Every page table empty, its prefix cache too (one per instance of a disaggregated engine)."""
    for bm in engine.scheduler.block_managers():
        bm.reset()


def reset_prefix_cache(engine: LLMEngine) -> bool:
    """Forget every cached prefix (vLLM's LLM.reset_prefix_cache, which RL loops call after changing the
    weights by hand): only between requests, when no block is held; False, and nothing done, otherwise."""
    if engine.has_unfinished() or engine._inflight:
        return False
    _reset_page_tables(engine)
    return True


WAKE_TAGS = ("weights", "kv_cache")  # vLLM's parts of a sleeping engine, woken together or one by one


def sleep(engine: LLMEngine, level: int = 1) -> None:
    """level 1: free the KV cache; level 2: the weights too (wake_up reloads them from the checkpoint
    folder the engine last loaded). Both parts count as asleep until woken (WAKE_TAGS): at level 1 waking
    the weights costs nothing."""
    _idle(engine, "sleep")
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    if engine.sleeping:
        raise RuntimeError(f"the engine is already asleep (level {engine.sleeping})")
    engine.executor.collective_rpc("sleep", (level,))
    _reset_page_tables(engine)
    engine.sleeping = level
    engine.asleep = set(WAKE_TAGS)


def wake_up(engine: LLMEngine, tags: list[str] | None = None) -> None:
    """Reallocate what sleep() freed; a no-op on an engine that is awake. `tags` (vLLM's): wake only these
    parts, e.g. ["weights"], then update_weights(), then ["kv_cache"], as RL loops do to hold the new
    weights and the old KV cache never at once; None: both."""
    if tags is not None:
        if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or not tags \
                or not set(tags) <= set(WAKE_TAGS):
            raise ValueError(f"wake_up tags must be a non-empty list of {', '.join(map(repr, WAKE_TAGS))} "
                             f"or None, got {tags!r}")
    if not engine.sleeping:
        return
    parts = list(WAKE_TAGS if tags is None else dict.fromkeys(tags))
    engine.executor.collective_rpc("wake_up", (parts,))
    engine.asleep -= set(parts)
    if not engine.asleep:
        engine.sleeping = 0


__all__ = ["SHAPE_FIELDS", "WAKE_TAGS", "WeightSource", "reset_prefix_cache", "sleep", "update_weights", "wake_up"]
