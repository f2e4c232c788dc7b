"""Logprobs and prompt logprobs against transformers: log_softmax of its logits is the oracle (fp32, 1e-4)."""
import pytest
import torch

from tdpipe import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,"]
TOL = 1e-4


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row j is the distribution of the token after ids[:j+1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def _check_position(entry: dict, ref: torch.Tensor, token: int, k: int) -> None:
    """entry: {token id: Logprob} at one position; ref: the oracle's logprobs there."""
    assert token in entry
    assert abs(entry[token].logprob - ref[token].item()) <= TOL
    assert entry[token].rank == int((ref > ref[token]).sum()) + 1 or abs(
        ref.sort(descending=True).values[entry[token].rank - 1] - ref[token]) <= TOL  # ties within tolerance
    top_v, top_i = ref.topk(k)
    ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in entry.items() if t != token or lp.rank <= k))
    assert len(entry) in (k, k + 1)
    for (rank, t, lp), v, i in zip(ranked, top_v.tolist(), top_i.tolist()):
        assert abs(lp - v) <= TOL, (rank, t, i)
        assert t == i or abs(ref[t].item() - v) <= TOL  # a near-tie may order differently
    for t, lp in entry.items():
        assert abs(lp.logprob - ref[t].item()) <= TOL


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_logprobs_match_transformers(llm_fp32, hf_fp32, temperature):
    k = 3
    tok = llm_fp32.get_tokenizer()
    sp = SamplingParams(temperature=temperature, seed=11, max_tokens=8, logprobs=k, ignore_eos=True)
    outs = llm_fp32.generate(PROMPTS, sp, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        ids = tok.encode(p)
        ref = _hf_logprobs(hf_fp32, ids + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) == 8
        total = 0.0
        for j, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            r = ref[len(ids) + j - 1]  # temperature 1 (or greedy): the model's own distribution
            _check_position(entry, r, t, k)
            total += r[t].item()
            if temperature == 0:
                assert entry[t].rank == 1
        assert abs(c.cumulative_logprob - total) <= 8 * TOL


def test_prompt_logprobs_match_transformers(llm_fp32, hf_fp32):
    k = 2
    tok = llm_fp32.get_tokenizer()
    outs = llm_fp32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k),
                             use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        ids = tok.encode(p)
        ref = _hf_logprobs(hf_fp32, ids)
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(ids)
        for j in range(1, len(ids)):
            _check_position(o.prompt_logprobs[j], ref[j - 1], ids[j], k)


def test_prompt_logprobs_in_chunks_and_temperature_scales_sample_logprobs(bundled_path, hf_fp32):
    """A chunked prefill (hybrid, 8-token budget) gives the same prompt logprobs; a temperature-2 sample's
    logprobs are those of logits / 2 (the distribution it was drawn from)."""
    llm = LLM(dtype="float32", num_kv_blocks=64, scheduler="hybrid", max_num_batched_tokens=8)
    try:
        tok = llm.get_tokenizer()
        p = PROMPTS[2]
        ids = tok.encode(p)
        assert len(ids) > 8
        o = llm.generate([p], SamplingParams(temperature=2.0, seed=5, max_tokens=3, logprobs=1,
                                             prompt_logprobs=1, ignore_eos=True), use_tqdm=False)[0]
        ref = _hf_logprobs(hf_fp32, ids)
        for j in range(1, len(ids)):
            _check_position(o.prompt_logprobs[j], ref[j - 1], ids[j], 1)
        c = o.outputs[0]
        with torch.no_grad():
            logits = hf_fp32(torch.tensor([ids + c.token_ids])).logits[0].float()
        for j, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            _check_position(entry, torch.log_softmax(logits[len(ids) + j - 1] / 2.0, -1), t, 1)
        llm.engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()


def test_no_logits_shipped_when_no_row_needs_them(llm_fp32):
    """Greedy rows without logprobs get argmax ids from the model (SiPipe §5.1); logprobs turn it off
    only for the batches that carry such a row."""
    from tdpipe.executor.local import LocalExecutor

    ex = llm_fp32.engine.executor
    assert isinstance(ex, LocalExecutor)
    seen = []
    collect = ex.collect

    def spy():
        result = collect()
        seen.append(result.token_ids is not None)
        return result
    ex.collect = spy
    try:
        llm_fp32.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert seen and all(seen)
        seen.clear()
        llm_fp32.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, logprobs=0), use_tqdm=False)
        assert seen and not any(seen)
    finally:
        del ex.collect
