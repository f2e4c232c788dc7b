"""Structured output on the bundled model (float32): JSON schemas sampled at temperature 1 parse and validate,
with n > 1 and logprobs; regex, choice, EBNF and json_object; and the same seeded answers at pp = 2 under
recompute preemption and with every policy, since the grammar state follows each sequence's outputs."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tdpipe import LLM, SamplingParams

pytestmark = pytest.mark.slow

# bounded, so every answer ends inside max_tokens whatever the sampled path: strings and arrays capped,
# integers in a range, whitespace between tokens capped by the grammar itself (sampling/grammar.py)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "active", "tags"],
}
PROMPTS = [f"Describe user number {i} of our website as a JSON object." for i in range(4)]


def _json(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=256, structured_outputs={"json": PERSON}, **kw)


def _ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_json_schema_at_temperature_1_with_n_and_logprobs(llm_fp32):
    outs = llm_fp32.generate(PROMPTS, [_json(i, n=2, logprobs=1) for i in range(len(PROMPTS))], use_tqdm=False)
    texts = set()
    for o in outs:
        assert len(o.outputs) == 2
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), PERSON)
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp[t].logprob > float("-inf") for lp, t in zip(c.logprobs, c.token_ids))
            texts.add(c.text)
    assert len(texts) > len(PROMPTS)  # sampled: the answers differ
    llm_fp32.engine.block_manager.check_no_leaks()


def test_regex_choice_grammar_and_json_object(llm_fp32):
    kinds = [
        ({"regex": r"[A-Z][a-z]{2,8} \d{2}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} \d{2}", t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'root ::= "(" digit ("+" digit)? ")"\ndigit ::= [0-9]'},
         lambda t: re.fullmatch(r"\(\d(\+\d)?\)", t)),
    ]
    for so, ok in kinds:
        sp = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=32, structured_outputs=so)
        for o in llm_fp32.generate(["Answer:", "The value is"], sp, use_tqdm=False):
            for c in o.outputs:
                assert ok(c.text) and c.finish_reason == "stop", (so, c.text)
    greedy = SamplingParams(temperature=0, max_tokens=128, structured_outputs={"json_object": True})
    for o in llm_fp32.generate(['Reply with the JSON object {"answer": 42} and nothing else:'], greedy,
                               use_tqdm=False):
        assert isinstance(json.loads(o.outputs[0].text), dict)


SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}}, "required": ["ok", "n"]}


def test_seeded_answers_equal_at_pp2_under_preemption_and_every_policy(llm_fp32):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs={"json": SMALL})
              for i in range(len(PROMPTS))]
    ref = _ids(llm_fp32.generate(PROMPTS, params, use_tqdm=False))
    for o in ref:
        assert len(o[0]) < 40  # room in the small cache below: the answers are not cut
    with LLM(dtype="float32", num_kv_blocks=6, pipeline_parallel_size=2) as pp2:  # throttle, as llm_fp32
        got = _ids(pp2.generate(PROMPTS, params, use_tqdm=False))
        assert pp2.engine.scheduler.num_preemptions > 0
        pp2.engine.block_manager.check_no_leaks()
    assert got == ref
    for policy in ("td-pipe", "hybrid", "separate"):  # throttle (the default) ran twice above
        with LLM(dtype="float32", kv_cache_memory=32 << 20, scheduler=policy) as llm:
            assert _ids(llm.generate(PROMPTS, params, use_tqdm=False)) == ref, policy


def test_an_invalid_schema_is_refused_at_submit_naming_it(llm_fp32):
    bad = SamplingParams(structured_outputs={"json": {"type": "nonsense"}})
    ok = SamplingParams(max_tokens=3, structured_outputs={"choice": ["a", "b"]})
    outs = llm_fp32.generate(["x", "y"], [bad, ok], use_tqdm=False)  # the batch's other prompt still runs
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[0].error.startswith("structured_outputs.json is not a valid JSON schema: Unsupported type")
    assert outs[1].outputs[0].text in ("a", "b")
    with pytest.raises(ValueError, match="structured_outputs.json is not a valid JSON schema"):
        llm_fp32.engine.add_request("direct", "x", bad)  # the engine's own check, for direct users
    llm_fp32.engine.block_manager.check_no_leaks()
    assert not llm_fp32.engine.requests
