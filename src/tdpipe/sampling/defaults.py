"""The model's own sampling defaults (vLLM's `--generation-config auto`, its default): a generation_config.json
that sets temperature, top_p, top_k, min_p, repetition_penalty or max_new_tokens supplies those values for
requests that leave them out: `LLM.generate(prompts)` without SamplingParams, `LLM.get_default_sampling_params()`
and the server's fields a request omits. An explicit SamplingParams is used as given, as in vLLM.
`--generation-config vllm` ignores the file (tdpipe's, which are vLLM's, defaults everywhere).
`--override-generation-config JSON` (vLLM's) sets the same keys over the file's, or alone with `vllm`.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from tdpipe.config import GENERATION_CONFIGS, GENERATION_SAMPLING_KEYS
from tdpipe.sampling.params import SamplingParams

log = logging.getLogger("tdpipe")

# generation_config.json's key -> SamplingParams' field
KEYS = {k: "max_tokens" if k == "max_new_tokens" else k for k in GENERATION_SAMPLING_KEYS}


def model_sampling_defaults(folder: str | None, mode: str = "auto",
                            override: dict[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams keywords from the folder's generation_config.json ({} with mode "vllm", without the
    file, or where the file's values are not valid sampling settings: then one warning names them), with
    `override`'s keys over them (a key outside KEYS, or a value SamplingParams refuses, is a ValueError naming
    override_generation_config)."""
    if mode not in GENERATION_CONFIGS:
        raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, got {mode!r}")
    base = {} if mode == "vllm" or folder is None else _from_file(folder)
    if not override:
        return base
    unknown = sorted(set(override) - set(KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: {', '.join(map(repr, unknown))} is not a sampling key of "
                         f"generation_config.json (known: {', '.join(KEYS)})")
    out = base | {KEYS[k]: v for k, v in override.items()}
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"override_generation_config {override}: {e}") from None
    log.info("sampling defaults: %s (override_generation_config over %s)", out,
             "the model's generation_config.json" if mode == "auto" else "tdpipe's own")
    return out


def _from_file(folder: str) -> dict[str, Any]:
    """The file's sampling keys, as SamplingParams keywords ({} when absent or invalid, with a warning)."""
    try:
        with open(os.path.join(folder, "generation_config.json"), encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(gen, dict):
        return {}
    out = {field: gen[key] for key, field in KEYS.items() if gen.get(key) is not None}
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        log.warning("%s/generation_config.json: its sampling defaults %s are not valid (%s); tdpipe's are used",
                    folder, out, e)
        return {}
    if out:
        log.info("sampling defaults from the model's generation_config.json: %s (--generation-config vllm "
                 "ignores them)", out)
    return out


__all__ = ["KEYS", "model_sampling_defaults"]
