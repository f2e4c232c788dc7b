"""Structured output without a model: the constraint's checks (one kind, types, size, xgrammar's parse naming
the kind), the sampler applying a grammar's bitmask to exactly its rows (greedy, sampled, logprobs), and the
OpenAI fields (response_format, structured_outputs, guided_*) mapped to one constraint."""
from __future__ import annotations

import pytest
import torch

from tdpipe.entrypoints.openai.errors import OpenAIError
from tdpipe.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tdpipe.sampling.grammar import parse_grammar
from tdpipe.sampling.metadata import SamplingMetadata
from tdpipe.sampling.params import SamplingParams
from tdpipe.sampling.sampler import Sampler
from tdpipe.sampling.structured import MAX_SPEC_CHARS, StructuredOutputsParams as S


@pytest.mark.parametrize("kw, msg", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"json": 5}, "structured_outputs.json must be a JSON schema"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"grammar": 7}, "structured_outputs.grammar must be a non-empty string"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true"),
    ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be a bool"),
    ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, "at most"),
])
def test_bad_constraints_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        S(**kw)


@pytest.mark.parametrize("kw, kind", [
    ({"json": '{"type": "nonsense"}'}, "json"),
    ({"json": "{not json"}, "json"),
    ({"regex": "(ab"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
])
def test_xgrammar_parse_errors_name_the_kind_without_cpp_noise(kw, kind):
    with pytest.raises(ValueError) as e:
        parse_grammar(S(**kw))
    msg = str(e.value)
    assert msg.startswith(f"structured_outputs.{kind} is not a valid"), msg
    assert "/project/cpp" not in msg and "Check failed" not in msg, msg


def test_valid_constraints_parse_and_key_keeps_property_order():
    for so in (S(json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}),
               S(json_object=True), S(regex=r"\d+"), S(choice=["yes", "no"]), S(grammar='root ::= "x"')):
        parse_grammar(so)
    a = S(json={"properties": {"b": {}, "a": {}}})
    b = S(json={"properties": {"a": {}, "b": {}}})
    assert a.key != b.key  # xgrammar writes properties in the schema's order: a different grammar
    assert S(choice=["a.b", "c"]).grammar_source() == ("regex", r"(a\.b|c)")


def test_json_object_means_an_object():
    """OpenAI's json_object is an object: xgrammar's built-in JSON grammar would also take `[true, 2]`."""
    import xgrammar as xgr

    how, text = S(json_object=True).grammar_source()
    g = xgr.Grammar.from_json_schema(text)
    assert how == "json"
    assert xgr.testing._is_grammar_accept_string(g, '{"a": [1, {"b": null}], "c": "d"}')
    assert not xgr.testing._is_grammar_accept_string(g, "[true, 2]")
    assert not xgr.testing._is_grammar_accept_string(g, "42")


def test_sampling_params_takes_a_dict_and_refuses_unknown_fields():
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert isinstance(p.structured_outputs, S) and p.structured_outputs.kind == "regex"
    with pytest.raises(ValueError, match="unknown field 'jsonn'"):
        SamplingParams(structured_outputs={"jsonn": {}})
    with pytest.raises(ValueError, match="StructuredOutputsParams or a dict"):
        SamplingParams(structured_outputs="json")


def _bitmask(rows: int, vocab: int, allowed: dict[int, list[int]]) -> torch.Tensor:
    """An xgrammar-layout bitmask: bit t % 32 of word t // 32 set where token t is allowed."""
    words = (vocab + 31) // 32
    bits = torch.zeros(rows, words * 32, dtype=torch.bool)
    for r, toks in allowed.items():
        bits[r, toks] = True
    weights = (1 << torch.arange(32, dtype=torch.int64))
    packed = (bits.view(rows, words, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def _meta(params, bitmask=None, rows=None, logprobs=None):
    b = len(params)
    return SamplingMetadata(params, [[]] * b, [[]] * b, [None] * b, num_logprobs=logprobs, bitmask=bitmask,
                            masked_rows=rows)


def test_greedy_rows_take_the_best_allowed_token_and_others_are_untouched():
    vocab = 70
    logits = torch.randn(3, vocab)
    allowed = {0: [5, 40, 69], 2: [33]}
    before = logits.clone()
    greedy = SamplingParams(temperature=0)
    toks = Sampler()(logits, _meta([greedy] * 3, _bitmask(3, vocab, allowed), [0, 2]))
    assert toks[0] == max(allowed[0], key=lambda t: logits[0, t])
    assert toks[1] == int(logits[1].argmax())
    assert toks[2] == 33
    assert torch.equal(logits, before)  # the caller's logits are never modified


def test_sampled_rows_never_draw_a_forbidden_token_and_logprobs_see_the_mask():
    vocab = 100
    logits = torch.zeros(64, vocab)  # flat: every token equally likely without the mask
    allowed = {r: [r % vocab, 99] for r in range(64)}
    params = [SamplingParams(temperature=1.0, top_p=0.9 if r % 2 else 1.0, logprobs=2) for r in range(64)]
    toks, lps = Sampler().sample(logits, _meta(params, _bitmask(64, vocab, allowed), list(range(64)), [2] * 64))
    for r, (t, lp) in enumerate(zip(toks, lps)):
        assert t in allowed[r]
        assert lp[0][1] == pytest.approx(-0.6931, abs=1e-3)  # two allowed tokens: log(1/2) each
    assert 99 in toks and any(t != 99 for t in toks)  # both allowed tokens drawn (each row: 1 / 2)


def _chat(**kw):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def test_openai_fields_map_to_one_constraint():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    so, field = _chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}).structured()
    assert so.json == schema and field == "response_format.json_schema.schema"
    so, field = _chat(response_format={"type": "json_object"}).structured()
    assert so.json_object and field == "response_format"
    assert _chat(response_format={"type": "text"}).structured() == (None, "")
    so, field = CompletionRequest.model_validate({"prompt": "a", "guided_choice": ["y", "n"]}).structured()
    assert so.choice == ["y", "n"] and field == "guided_choice"
    so, field = CompletionRequest.model_validate({"prompt": "a", "structured_outputs": {"regex": "a"}}).structured()
    assert so.regex == "a" and field == "structured_outputs.regex"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format.json_schema.schema"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
])
def test_openai_field_errors_are_400s_naming_the_field(body, param):
    with pytest.raises(OpenAIError) as e:
        _chat(**body).structured()
    assert e.value.status == 400 and e.value.param == param, (e.value.status, e.value.param, str(e.value))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bitmask_kernels_match_xgrammar_and_torch(dtype):
    import xgrammar as xgr

    from tdpipe.model import cpu_ops
    from tdpipe.sampling.token_masks import apply_bitmask, masked_argmax

    if cpu_ops.kernel() is None:
        pytest.skip("no C++ toolchain: the xgrammar / torch fallbacks run instead (covered by the tests above)")
    g = torch.Generator().manual_seed(0)
    rows, vocab = 9, 1000  # not a multiple of 32: the last word is partial
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    logits[3, 10:20] = 5.0  # ties: the first allowed index wins, as torch's argmax
    allowed = {r: torch.randperm(vocab, generator=g)[: [1, 3, 40, 999, 500, 2, 7, 64, 1][r]].tolist()
               for r in range(rows)}
    allowed[3] = [12, 15, 17]
    allowed[8] = []  # nothing allowed: -1
    mask = _bitmask(rows, vocab, allowed)
    x = logits.float()
    ours, ref = x.clone(), x.clone()
    apply_bitmask(ours, mask)
    xgr.apply_token_bitmask_inplace(ref, mask, vocab_size=vocab)
    assert torch.equal(ours, ref)
    want = list(range(rows))
    got = masked_argmax(logits, mask, want)
    assert got[3] == 12 and got[8] == -1
    for r in range(rows - 1):
        assert got[r] == int(ref[r].argmax()), r
    assert masked_argmax(logits, mask, [5, 0]) == [got[5], got[0]]
