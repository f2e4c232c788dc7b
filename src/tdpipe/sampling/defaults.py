"""The model's own sampling defaults (vLLM's `--generation-config auto`, its default): a generation_config.json
that sets temperature, top_p, top_k, min_p, repetition_penalty or max_new_tokens supplies those values for
requests that leave them out: `LLM.generate(prompts)` without SamplingParams, `LLM.get_default_sampling_params()`
and the server's fields a request omits. An explicit SamplingParams is used as given, as in vLLM.
`--generation-config vllm` ignores the file (tdpipe's, which are vLLM's, defaults everywhere).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from tdpipe.config import GENERATION_CONFIGS
from tdpipe.sampling.params import SamplingParams

log = logging.getLogger("tdpipe")

# generation_config.json's key -> SamplingParams' field (vLLM's get_diff_sampling_param reads these six)
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def model_sampling_defaults(folder: str, mode: str = "auto") -> dict[str, Any]:
    """SamplingParams keywords from the folder's generation_config.json ({} with mode "vllm", without the
    file, or where the file's values are not valid sampling settings: then one warning names them)."""
    if mode not in GENERATION_CONFIGS:
        raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, got {mode!r}")
    if mode == "vllm":
        return {}
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
