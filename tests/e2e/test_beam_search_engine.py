"""LLM.beam_search (vLLM's) on the random Qwen2, float32, transformers the oracle: one beam is the greedy
answer, and every returned beam's cumulative logprob is the sum of transformers' log-probabilities of its
tokens, beams ranked by vLLM's score."""
import pytest
import torch

from conftest import hf_greedy
from tdpipe import LLM
from tdpipe.sampling.beam_search import BeamSearchParams

pytestmark = pytest.mark.slow

PROMPTS = [list(range(100, 117)), [7, 8, 9]]


def _hf_logprob(model, tokens: list[int], start: int) -> float:
    with torch.no_grad():
        lp = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
    return sum(float(lp[i - 1, tokens[i]]) for i in range(start, len(tokens)))


def test_beams_match_transformers(qwen2_tiny):
    folder, hf = qwen2_tiny
    with LLM(model=folder, dtype="float32", kv_cache_memory=32 << 20) as llm:
        one = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                              BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
        three = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                                BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
        llm.engine.block_manager.check_no_leaks()
        with pytest.raises(ValueError, match="prompt 0"):
            llm.beam_search([[]], BeamSearchParams(beam_width=2, max_tokens=2))
    for p, out in zip(PROMPTS, one):
        assert out.sequences[0].tokens == p + hf_greedy(hf, p, 6)
    for p, out in zip(PROMPTS, three):
        seqs = out.sequences
        assert len(seqs) == 3 and len({tuple(s.tokens) for s in seqs}) == 3
        scores = [s.cum_logprob / len(s.tokens) for s in seqs]
        assert scores == sorted(scores, reverse=True)
        for s in seqs:
            assert s.tokens[:len(p)] == p and len(s.tokens) == len(p) + 6 and s.finish_reason == "length"
            assert s.cum_logprob == pytest.approx(_hf_logprob(hf, s.tokens, len(p)), abs=1e-3)
            assert isinstance(s.text, str) and len(s.logprobs) == 6
        # the best of three beams scores at least as well as the greedy beam
        assert scores[0] >= one[PROMPTS.index(p)].sequences[0].cum_logprob / (len(p) + 6) - 1e-6
