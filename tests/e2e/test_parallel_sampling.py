"""n > 1 and best_of on the real model: the prompt is prefilled once and forked; the shared last block is
copied on first write (copy-on-write); seeds, preemption and abort keep every sample correct and leak-free."""
import pytest

from conftest import hf_greedy
from tdpipe import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4,"]


def _count_copies(llm: LLM) -> list[int]:
    """Wrap the scheduler so the copy-on-write pairs shipped with batches are counted."""
    sched = llm.engine.scheduler
    take = sched.take_block_copies
    n = [0]

    def counted():
        copies = take()
        n[0] += len(copies)
        return copies
    sched.take_block_copies = counted
    return n


@pytest.mark.parametrize("pp", [1, 2])
def test_greedy_samples_equal_the_greedy_answer(bundled_path, hf_fp32, pp):
    llm = LLM(dtype="float32", num_kv_blocks=128, pipeline_parallel_size=pp)
    try:
        copies = _count_copies(llm)
        tok = llm.get_tokenizer()
        outs = llm.generate(PROMPTS, SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)
        for p, o in zip(PROMPTS, outs):
            ref = hf_greedy(hf_fp32, tok.encode(p), 20)
            assert [c.index for c in o.outputs] == [0, 1, 2]
            assert all(c.token_ids == ref for c in o.outputs), p
        assert copies[0] > 0  # the prompts end inside a block: every child copied it before writing
        # prompt tokens were prefilled once per request, not once per sample
        assert llm.engine.stats.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
        llm.engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()


def test_seeded_samples_do_not_depend_on_the_batch_or_preemption(bundled_path):
    sp = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=40, ignore_eos=True)
    big = LLM(dtype="float32", num_kv_blocks=256)
    try:
        alone = big.generate(PROMPTS[:1], sp, use_tqdm=False)[0]
        crowd = big.generate(PROMPTS + ["Hello"] * 5, [sp] + [SamplingParams(n=2, temperature=0.7, max_tokens=30)]
                             * 7, use_tqdm=False)[0]
    finally:
        big.shutdown()
    tight = LLM(dtype="float32", num_kv_blocks=9, max_model_len=144)  # 4 samples x ~3 blocks: preemption
    try:
        pre = tight.generate(PROMPTS[:1], sp, use_tqdm=False)[0]
        assert tight.engine.scheduler.num_preemptions > 0
        tight.engine.block_manager.check_no_leaks()
    finally:
        tight.shutdown()
    ids = [c.token_ids for c in alone.outputs]
    assert len({tuple(i) for i in ids}) == 4  # four different samples
    assert [c.token_ids for c in crowd.outputs] == ids
    assert [c.token_ids for c in pre.outputs] == ids


def test_best_of_keeps_the_most_likely(llm_fp32):
    sp = SamplingParams(n=2, best_of=6, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    o = llm_fp32.generate(PROMPTS[:1], sp, use_tqdm=False)[0]
    assert [c.index for c in o.outputs] == [0, 1]
    everyone = llm_fp32.generate(PROMPTS[:1], SamplingParams(n=6, temperature=1.0, seed=9, max_tokens=12,
                                                              ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    for c in everyone.outputs:  # each sample's own tokens, the first (sampled at the fork) included
        assert abs(c.cumulative_logprob - sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids))) < 1e-4
    best = sorted(everyone.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in o.outputs] == [c.token_ids for c in best]
    assert [round(c.cumulative_logprob, 4) for c in o.outputs] == [round(c.cumulative_logprob, 4) for c in best]
    assert o.outputs[0].logprobs is None  # ranked by logprob, not asked to return them


def test_abort_and_early_exit_free_every_sample(llm_fp32):
    """Leaving generate_unordered early aborts groups mid-decode (some children in flight, some waiting)."""
    sp = SamplingParams(n=5, temperature=1.0, max_tokens=200, ignore_eos=True)
    gen = llm_fp32.generate_unordered(PROMPTS * 3, [SamplingParams(temperature=0, max_tokens=2)] + [sp] * 8,
                                      use_tqdm=False)
    next(gen)
    gen.close()
    eng = llm_fp32.engine
    assert not eng.requests and not eng.scheduler.has_unfinished()
    eng.block_manager.check_no_leaks()


def test_stop_string_ends_one_sample_only(llm_fp32):
    """A stop string found by the frontend aborts that sample in the core; its siblings go on."""
    sp = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=30, stop=[" the"], ignore_eos=True)
    o = llm_fp32.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    reasons = [c.finish_reason for c in o.outputs]
    assert "stop" in reasons and len(o.outputs) == 4
    for c in o.outputs:
        assert " the" not in c.text
        assert (c.finish_reason == "stop") == (c.stop_reason == " the")
    llm_fp32.engine.block_manager.check_no_leaks()
