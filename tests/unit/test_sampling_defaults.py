"""The model's sampling defaults (sampling/defaults.py, vLLM's --generation-config auto): read from
generation_config.json in SamplingParams' names, ignored with "vllm" or when invalid; the server fills the
fields a request leaves out with them, and what the request sets wins."""
import json
import logging

import httpx
import pytest

from fake_engine_client import FakeAsyncLLM
from tdpipe.entrypoints.openai.api_server import ServerConfig, build_app
from tdpipe.sampling.defaults import model_sampling_defaults

QWEN = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "max_new_tokens": 100, "eos_token_id": [1, 2], "bos_token_id": 3}


def test_read_in_sampling_params_names(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN))
    assert model_sampling_defaults(str(tmp_path)) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                      "repetition_penalty": 1.05, "max_tokens": 100}
    assert model_sampling_defaults(str(tmp_path), "vllm") == {}
    assert model_sampling_defaults(str(tmp_path / "missing")) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 5.0, "temperature": None}))
    with caplog.at_level(logging.WARNING, logger="tdpipe"):
        assert model_sampling_defaults(str(tmp_path)) == {}
    assert "not valid" in caplog.text and "top_p" in caplog.text
    with pytest.raises(ValueError, match="generation_config must be one of auto, vllm"):
        model_sampling_defaults(str(tmp_path), "hf")


@pytest.mark.anyio
async def test_the_server_fills_omitted_fields_with_them():
    eng = FakeAsyncLLM()
    eng.default_sampling = {"temperature": 0.3, "top_k": 5, "max_tokens": 9}
    app = build_app(eng, ServerConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        await c.post("/v1/completions", json={"prompt": "hi", "temperature": 1.0, "top_k": None})
    chat, comp = eng.requests[0][1], eng.requests[1][1]
    assert (chat.temperature, chat.top_k, chat.max_tokens) == (0.3, 5, 9)
    # completions' max_tokens defaults to 16 (OpenAI's); a field sent null takes the model's default
    assert (comp.temperature, comp.top_k, comp.max_tokens) == (1.0, 5, 16)


def test_override_generation_config_over_the_file_or_alone(tmp_path):
    """vLLM's --override-generation-config: its keys over the file's with auto, alone with vllm; a key that
    is not a sampling key, or a value SamplingParams refuses, is an error naming the setting."""
    from tdpipe.cli import build_parser
    from tdpipe.config import EngineConfig
    from tdpipe.engine_args import EngineArgs

    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN))
    over = {"temperature": 0.2, "max_new_tokens": 7}
    assert model_sampling_defaults(str(tmp_path), "auto", over) == {"temperature": 0.2, "top_p": 0.8, "top_k": 20,
                                                                    "repetition_penalty": 1.05, "max_tokens": 7}
    assert model_sampling_defaults(str(tmp_path), "vllm", over) == {"temperature": 0.2, "max_tokens": 7}
    with pytest.raises(ValueError, match="override_generation_config .*top_p"):
        model_sampling_defaults(str(tmp_path), "vllm", {"top_p": 3.0})
    with pytest.raises(ValueError, match="override_generation_config: 'do_sample' is not a sampling key"):
        EngineConfig(override_generation_config={"do_sample": True})
    a = build_parser().parse_args(["generate", "--override-generation-config", '{"temperature": 0.5}', "x"])
    assert EngineArgs.from_cli(a).create_engine_config().override_generation_config == {"temperature": 0.5}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--override-generation-config", "[1]", "x"])


def test_override_reaches_the_engine(tmp_path):
    """LLM(..., override_generation_config=...) on a random in-memory model: the engine's defaults."""
    from tdpipe.core.engine import LLMEngine
    from tdpipe.config import CacheConfig, EngineConfig

    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 50, "max_position_embeddings": 64}
    cfg = EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=8), override_generation_config={"top_k": 3})
    eng = LLMEngine.from_config(cfg, hf_config=hf, seed=1)
    try:
        assert eng.default_sampling == {"top_k": 3}
    finally:
        eng.shutdown()
