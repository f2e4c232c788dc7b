"""Batch inference on a Ray cluster with Ray Data, in the shape vLLM's `ray.data.llm` users know.

    import ray
    from tdpipe.ray import ProcessorConfig, build_llm_processor

    config = ProcessorConfig(engine_kwargs={"dtype": "bfloat16"}, concurrency=2, batch_size=32)
    processor = build_llm_processor(
        config,
        preprocess=lambda row: {"question": row["question"], "messages": [{"role": "user", "content": row["question"]}],
                                "sampling_params": {"max_tokens": 64}},
        postprocess=lambda row: {"question": row["question"], "answer": row["generated_text"]})
    answers = processor(ray.data.from_items([{"question": "..."}, ...])).take_all()

Each replica is a Ray actor (`concurrency` of them, each with `num_cpus_per_replica` CPUs and no GPU) that
holds one `LLM` for its life and answers a block of rows at a time with one `generate` call: the rows of a
block run as one continuous batch. Ray places the actors, moves the rows and retries failed tasks; tdpipe
has no cluster manager of its own. Ray is an optional extra (`pip install 'tdpipe[ray]'`); this module
imports it only when a processor is built.

A row given to the engine carries `prompt` (text or token ids) or `messages` (a chat, through the model's
template), and optionally `sampling_params` (a dict of SamplingParams fields). The engine adds
`generated_text`, `generated_token_ids`, `num_input_tokens`, `num_generated_tokens`, `finish_reason` and
`error` (empty unless the row was refused) to each row and keeps the row's other columns.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LLMPredictor", "ProcessorConfig", "build_llm_processor"]

Row = dict[str, Any]


@dataclass
class ProcessorConfig:
    """`model`: a Hugging Face folder or GGUF file every node can read (None: the bundled model);
    `engine_kwargs`: LLM()'s other keywords; `concurrency`: replicas (Ray actors); `batch_size`: rows per
    generate call; `num_cpus_per_replica`: CPUs Ray reserves for each (its engine's threads)."""

    model: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 1
    batch_size: int = 64
    num_cpus_per_replica: int = 1

    def __post_init__(self) -> None:
        for name in ("concurrency", "batch_size", "num_cpus_per_replica"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ProcessorConfig.{name} must be an integer >= 1, got {v!r}")
        if "model" in self.engine_kwargs:  # else each actor dies in LLM() with "multiple values for 'model'"
            raise ValueError("ProcessorConfig.engine_kwargs must not hold 'model': give it as ProcessorConfig.model")


class LLMPredictor:
    """One replica: an LLM built once per actor; called with a batch of rows (column -> values)."""

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any], num_threads: int) -> None:
        from tdpipe import LLM

        self.llm = LLM(model=model, **({"num_threads": num_threads} | engine_kwargs))

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        from tdpipe.entrypoints.conversation import check_conversation
        from tdpipe.sampling.params import SamplingParams
        from tdpipe.tokenizer import chat_prompt

        n = len(next(iter(batch.values()))) if batch else 0
        rows = [{k: _plain(v[i]) for k, v in batch.items()} for i in range(n)]
        prompts, params = [], []
        tok = self.llm.get_tokenizer()
        for r in rows:
            if r.get("messages") is not None:
                text, ids = chat_prompt(tok, check_conversation(r["messages"]))
                prompts.append({"prompt": text, "prompt_token_ids": ids})
            else:
                p = r.get("prompt")
                prompts.append({"prompt_token_ids": p} if isinstance(p, list) else p)
            sp = r.get("sampling_params") or {}
            params.append(sp if isinstance(sp, SamplingParams) else dict(sp))
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        cols: dict[str, list] = {k: [r.get(k) for r in rows] for k in batch}
        cols["generated_text"] = [o.outputs[0].text for o in outs]
        cols["generated_token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        cols["num_input_tokens"] = [len(o.prompt_token_ids) for o in outs]
        cols["num_generated_tokens"] = [len(o.outputs[0].token_ids) for o in outs]
        cols["finish_reason"] = [o.outputs[0].finish_reason for o in outs]
        cols["error"] = [o.error or "" for o in outs]
        return cols


def _plain(v: Any) -> Any:
    """A Ray Data cell as plain Python (numpy arrays and scalars become lists and numbers)."""
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def build_llm_processor(config: ProcessorConfig, preprocess: Callable[[Row], Row] | None = None,
                        postprocess: Callable[[Row], Row] | None = None) -> Callable[[Any], Any]:
    """A function Dataset -> Dataset: `preprocess` per row, the replicas on blocks of `batch_size` rows,
    `postprocess` per row (vLLM's build_llm_processor shape)."""
    import ray.data  # the optional extra: a clear ImportError here, not inside a worker

    def process(ds: Any) -> Any:
        if preprocess is not None:
            ds = ds.map(preprocess)
        ds = ds.map_batches(
            LLMPredictor, batch_size=config.batch_size, batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=config.concurrency),
            num_cpus=config.num_cpus_per_replica, num_gpus=0,
            fn_constructor_kwargs={"model": config.model, "engine_kwargs": dict(config.engine_kwargs),
                                   "num_threads": config.num_cpus_per_replica})
        if postprocess is not None:
            ds = ds.map(postprocess)
        return ds

    return process
