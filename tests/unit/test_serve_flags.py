"""vLLM's serve flags beyond the engine's: --chat-template (a file or the template itself; a model without a
template then chats), CORS (vLLM's defaults: any origin; a browser's preflight answered before the API key is
asked for), --uvicorn-log-level, --disable-uvicorn-access-log; and LLM.chat's chat_template keyword."""
import httpx
import pytest

from fake_engine_client import FakeAsyncLLM, FakeTokenizer
from tdpipe.cli import build_parser
from tdpipe.entrypoints.openai.api_server import build_app, set_engine, uvicorn_config
from tdpipe.entrypoints.openai.serve_args import ServerConfig, read_chat_template, server_config
from tdpipe.tokenizer import NoChatTemplate, chat_prompt

pytestmark = pytest.mark.anyio
TEMPLATE = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
USER = [{"role": "user", "content": "hi"}]


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_chat_template_from_a_file_or_itself(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert read_chat_template(str(f)) == TEMPLATE and read_chat_template(TEMPLATE) == TEMPLATE
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match="--chat-template 'nope.jinja': no such file"):
        read_chat_template("nope.jinja")


async def test_chat_template_renders_chat_and_tokenize_for_a_model_without_one():
    eng = FakeAsyncLLM(max_model_len=512)
    eng.tokenizer.chat_template = None  # a base model
    app = build_app(None, ServerConfig(chat_template=TEMPLATE))
    async with _client(app) as c:
        set_engine(app, eng)  # as serve attaches the engine once it has started
        r = await c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert eng.tokenizer.decode(eng.requests[-1][0]) == "[user:hi]>"
        tok = await c.post("/tokenize", json={"messages": USER})
        assert tok.json()["count"] == len("[user:hi]>")


async def test_without_a_template_a_base_model_refuses_chat():
    eng = FakeAsyncLLM()
    eng.tokenizer.chat_template = None
    async with _client(build_app(eng)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


async def test_cors_preflight_and_answers_as_vllm_by_default():
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    async with _client(build_app(FakeAsyncLLM(), ServerConfig(api_key="k"))) as c:
        r = await c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                         headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = await c.post("/v1/completions", json={"prompt": "hi"}, headers={"Origin": "http://ui.example"})
        assert r.status_code == 401  # CORS lets the browser ask; the key still decides
    cfg = ServerConfig(allowed_origins=("http://ok.example",))
    async with _client(build_app(FakeAsyncLLM(), cfg)) as c:
        r = await c.options("/v1/completions", headers=preflight)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_flags_reach_the_server_config(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    a = build_parser().parse_args(["serve", "--chat-template", str(f), "--uvicorn-log-level", "warning",
                                   "--allowed-origins", '["http://a"]', "--allow-credentials",
                                   "--disable-uvicorn-access-log", "--tokenizer-mode", "auto"])
    cfg = server_config(a)
    assert cfg.chat_template == TEMPLATE and cfg.allowed_origins == ("http://a",) and cfg.allow_credentials
    assert not cfg.access_log and a.tokenizer_mode == "auto"
    assert uvicorn_config(build_app(None, cfg), cfg).log_level == "warning"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "*"])
    with pytest.raises(ValueError, match="uvicorn_log_level"):
        ServerConfig(uvicorn_log_level="loud")


def test_offline_chat_template_keyword():
    tok = FakeTokenizer()
    tok.chat_template = None
    with pytest.raises(NoChatTemplate):
        chat_prompt(tok, USER)
    assert chat_prompt(tok, USER, chat_template=TEMPLATE)[0] == "[user:hi]>"


def test_run_batch_shapes_answers_with_the_same_flags(tmp_path):
    """run-batch takes serve's answer flags (tools, reasoning, chat template, cached tokens) and refuses a bad
    combination before it writes anything."""
    from tdpipe.entrypoints.openai.serve_args import answer_settings
    from tdpipe.entrypoints.preflight import PreflightError
    from tdpipe.entrypoints.run_batch import cmd_run_batch

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"custom_id": "1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n')
    a = build_parser().parse_args(["run-batch", "-i", str(src), "-o", str(out), "--reasoning-parser", "qwen3",
                                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                   "--chat-template", TEMPLATE, "--enable-prompt-tokens-details"])
    assert answer_settings(a) == {"chat_template": TEMPLATE, "enable_prompt_tokens_details": True,
                                  "enable_auto_tool_choice": True, "tool_call_parser": "hermes",
                                  "reasoning_parser": "qwen3"}
    bad = build_parser().parse_args(["run-batch", "-i", str(src), "-o", str(out), "--enable-auto-tool-choice"])
    with pytest.raises(PreflightError, match="needs tool_call_parser"):
        cmd_run_batch(bad)
    assert not out.exists()
