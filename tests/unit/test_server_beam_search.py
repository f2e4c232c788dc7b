"""vLLM's use_beam_search on /v1/completions and /v1/chat/completions (entrypoints/openai/beam.py), over a
fake engine whose next-token log-probabilities come from a fixed toy table: the server's choices are the
offline search's (sampling/beam_search.py over the same table) best first, text and ids alike, whole and
streamed; fields a beam search cannot honour are 400s naming them; a step request per live beam."""
import json
import math

import httpx
import pytest

from fake_engine_client import EOS, OFFSET, FakeAsyncLLM
from tdpipe.entrypoints.openai.api_server import build_app
from tdpipe.entrypoints.openai.serve_args import ServerConfig
from tdpipe.outputs import CompletionOutput, Logprob, RequestOutput
from tdpipe.sampling.beam_search import BeamSearchParams, beam_search

pytestmark = pytest.mark.anyio
LETTERS = [OFFSET + ord(c) for c in "abc"]


def toy(tokens: list[int]) -> dict[int, float]:
    """A next-token distribution over a, b, c and EOS that depends on the last two tokens."""
    a, b = ([0, 0] + tokens)[-2:]
    w = {t: 1.0 + ((a * 7 + b * 3 + t * 5) % 11) for t in LETTERS + [EOS]}
    z = sum(w.values())
    return {t: math.log(v / z) for t, v in w.items()}


class ToyEngine(FakeAsyncLLM):
    """A step request (max_tokens 1 with logprobs) answers from the toy table; the rest as FakeAsyncLLM."""

    async def generate(self, prompt, params=None, request_id=None):
        if params is None or params.logprobs is None:
            async for out in super().generate(prompt, params, request_id):
                yield out
            return
        ids = list(prompt)
        self.requests.append((ids, params, request_id))
        lps = toy(ids)
        best = max(lps, key=lps.get)
        entry = {t: Logprob(v) for t, v in sorted(lps.items(), key=lambda kv: -kv[1])[:params.logprobs]}
        yield RequestOutput(request_id, None, ids, [CompletionOutput(0, "", [best], "length", None, lps[best],
                                                                     [entry])])


async def post(path: str, body: dict, eng: FakeAsyncLLM | None = None) -> httpx.Response:
    app = build_app(eng or ToyEngine(max_model_len=256), ServerConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return await c.post(path, json=body)


def offline(prompt_ids: list[int], n: int, max_tokens: int, length_penalty: float = 1.0) -> list[list[int]]:
    step = lambda batch: [{t: Logprob(v) for t, v in toy(b).items()} for b in batch]  # noqa: E731
    [out] = beam_search([prompt_ids], BeamSearchParams(beam_width=n, max_tokens=max_tokens,
                                                       length_penalty=length_penalty), step, frozenset({EOS}), 256)
    return [[t for t in b.tokens[len(prompt_ids):] if t != EOS] for b in out.sequences]


@pytest.mark.parametrize("penalty", [1.0, 0.5])
async def test_completions_choices_are_the_offline_search(penalty):
    eng = ToyEngine(max_model_len=256)
    body = {"prompt": "ab", "max_tokens": 5, "n": 3, "use_beam_search": True, "length_penalty": penalty,
            "return_token_ids": True}
    r = await post("/v1/completions", body, eng)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    want = offline(eng.tokenizer.encode("ab"), 3, 5, penalty)
    assert [c["token_ids"] for c in choices] == want and [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["text"] == bytes(t - OFFSET for t in c["token_ids"]).decode() for c in choices)
    assert {c["finish_reason"] for c in choices} <= {"stop", "length"}
    assert r.json()["usage"]["completion_tokens"] == sum(len(w) for w in want)
    assert all(p.logprobs == 6 and p.max_tokens == 1 for _, p, _ in eng.requests)  # 2 x n per step


async def test_chat_and_a_stream_give_the_same_choices():
    whole = (await post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                 "max_tokens": 4, "use_beam_search": True})).json()
    r = await post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                            "max_tokens": 4, "use_beam_search": True, "stream": True})
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    streamed = ["".join(e["choices"][0]["delta"].get("content") or "" for e in events
                        if e["choices"] and e["choices"][0]["index"] == k) for k in range(2)]
    assert [c["message"]["content"] for c in whole["choices"]] == streamed
    assert len(set(streamed)) == 2


@pytest.mark.parametrize("extra, field", [({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"),
                                          ({"n": 11}, "n"), ({"best_of": 2}, "best_of")])
async def test_what_a_beam_search_cannot_honour_is_a_400_naming_it(extra, field):
    r = await post("/v1/completions", {"prompt": "ab", "max_tokens": 3, "use_beam_search": True, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
