"""Seeded sampling is reproducible under recompute preemption: each output position draws from a stream
keyed by (seed, position), so nothing a preemption does (drop the KV, prefill prompt + outputs again, run
the request in other batches) can shift a later draw. Unit checks run without a model; the end-to-end
checks (`slow`) compare a preempting run with one whose cache never runs out, on the tiny random Qwen2 (the
bundled model's tokenizer, so the same prompts take the same blocks and preempt the same way): the point is
the sampler's streams, not the answers."""
from __future__ import annotations

import hashlib

import pytest
import torch

from tdpipe.sampling import SamplingParams
from tdpipe.sampling.metadata import SamplingMetadata
from tdpipe.sampling.sampler import CANDIDATES, Sampler, draw_key, draw_keys, make_generator

V = 3000


def _steps(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


# ---------------------------------------------------------------- keyed draws (no model)

def test_draw_keys_match_draw_key_and_do_not_collide():
    seeds = [0, 1, 2, -1, -(2**63), 2**64 - 1, 2**63, 12345] * 2
    idx = list(range(8)) + [10**6 + i for i in range(8)]
    assert draw_keys(seeds, idx) == [draw_key(s, i) for s, i in zip(seeds, idx)]
    keys = {draw_key(s, i) for s in range(200) for i in range(200)}
    assert len(keys) == 200 * 200  # neighbouring (seed, position) pairs get unrelated streams
    assert all(0 <= k < 2**64 for k in keys)
    assert draw_key(-1, 3) == draw_key(2**64 - 1, 3)  # negative seeds are taken modulo 2**64, as torch does


def test_position_draw_ignores_history_and_batch():
    """Sampling position i again (a recompute), skipping positions (a discarded in-flight result), or
    sampling it beside other rows gives the same token: the draw depends on (seed, i) only."""
    sp = SamplingParams(temperature=1.0, seed=7)
    steps = _steps(12)
    s = Sampler()

    def alone(i: int) -> int:
        return s(steps[i:i + 1], SamplingMetadata([sp], [[]], [[]], [draw_key(7, i)]))[0]

    ref = [alone(i) for i in range(12)]
    assert [alone(i) for i in reversed(range(12))] == ref[::-1]
    assert [alone(i) for i in (5, 5, 5)] == [ref[5]] * 3
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, seed=99), SamplingParams(temperature=0)]
    for i in range(12):
        batch = torch.cat([_steps(1, 100 + i), steps[i:i + 1], _steps(2, 200 + i)])
        params = [others[0], sp, others[1], others[2]]
        keys = [None, draw_key(7, i), draw_key(99, i), None]
        assert s(batch, SamplingMetadata(params, [[]] * 4, [[]] * 4, keys))[1] == ref[i]
    assert [s(steps[i:i + 1], SamplingMetadata([sp], [[]], [[]], [draw_key(8, i)]))[0] for i in range(12)] != ref


def _nucleus_flip_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0 in two variants that differ only in whether the top-p nucleus fits in the CANDIDATES fast
    path (peaked) or needs the full vocabulary (flat); steps 1.. are identical."""
    later = _steps(10, 3)
    peaked = torch.full((1, V), -20.0)
    peaked[0, :5] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    flat = torch.zeros(1, V)
    flat[0, :5] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0]) * 1e-3
    return torch.cat([peaked, later]), torch.cat([flat, later])


def test_root_cause_a_stateful_stream_shifts_when_one_step_changes_path():
    """Why the per-request generator diverged: its draws per step are one per column, CANDIDATES on the
    top-k/top-p fast path and the whole vocabulary on the full path, and which path a row takes depends
    on its logits. Logits a few ulps apart (the same request in a batch of another shape, as after a
    preemption) can flip the path at one step and so shift every later draw of the request. A keyed
    stream only ever depends on (seed, position)."""
    assert CANDIDATES < V
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    a, b = _nucleus_flip_logits()
    s = Sampler()

    def run(steps: torch.Tensor, keyed: bool) -> list[int]:
        g = make_generator(sp)
        return [s(steps[i:i + 1], SamplingMetadata([sp], [[]], [[]], [draw_key(11, i) if keyed else g]))[0] for i in range(len(steps))]

    assert run(a, keyed=True)[1:] == run(b, keyed=True)[1:]
    assert run(a, keyed=False)[1:] != run(b, keyed=False)[1:]


def test_banned_tokens_and_inference_tensors():
    """min_tokens bans: never sampled, ids past the vocabulary ignored, the caller's logits untouched, and an
    fp32 inference-mode tensor (what the executor returns) accepted: banning in place used to raise."""
    with torch.inference_mode():
        logits = torch.zeros(3, V)
        logits[:, 5] = 50.0
    before = logits.clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0)]
    banned = [[5, V + 10, 2**40], [5], []]
    toks = Sampler()(logits, SamplingMetadata(params, [[]] * 3, [[]] * 3, [None, draw_key(1, 0), None], banned))
    assert toks[0] != 5 and toks[1] != 5 and toks[2] == 5
    greedy = [SamplingParams(temperature=0)] * 3  # the all-greedy hot path masks a copy of row 0 alone
    toks = Sampler()(logits, SamplingMetadata(greedy, [[]] * 3, [[]] * 3, [None] * 3, [[5], [], [V + 1]]))
    assert toks[0] != 5 and toks[1:] == [5, 5]
    assert torch.equal(logits, before)


def test_reseeding_cost_is_small():
    """Reseeding the scratch generator per seeded row: ~2 us a row, ~0.4 ms for 256 rows here (vs a decode
    step of ~20 ms). Loose bound: this machine is shared."""
    import time

    g = torch.Generator()
    seeds, idx = list(range(256)), [17] * 256
    best = float("inf")
    for _ in range(20):
        t = time.perf_counter()
        for k in draw_keys(seeds, idx):
            g.manual_seed(k)
        best = min(best, time.perf_counter() - t)
    assert best < 5e-3, best


# ---------------------------------------------------------------- end to end on the tiny random Qwen2

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "Once upon a time, in a land far away, there lived a young girl who", "def fibonacci(n):",
           "Q: What is the boiling point of water at sea level?\nA:", "Hi", "List three colours of the rainbow",
           "Tell me a story about a dragon", "The quick brown fox", "import numpy as np\n", "My favourite food is",
           "In 1492,", "Dear diary,", "The weather today", "Recipe for pancakes:"]


def _params() -> list[SamplingParams]:
    """Temperature 1.0 everywhere (divergence would show at once); a few rows also exercise the top-p
    fast path, min_tokens bans and penalties."""
    extra = [{}, {}, {"top_p": 0.9}, {"min_tokens": 10}, {}, {"top_k": 50, "repetition_penalty": 1.1}]
    return [SamplingParams(temperature=1.0, max_tokens=48, seed=1000 + i, ignore_eos=True, **extra[i % len(extra)])
            for i in range(len(PROMPTS))]


def _run(model: str, dtype: str, num_kv_blocks: int | None, keep: dict | None = None,
         replay: dict | None = None) -> tuple[list[list[int]], dict, int]:
    """Tokens per request, a digest of the logits each position was sampled from, and the preemptions.
    `keep` collects each position's logits row, keyed by (prompt ids, position); `replay` substitutes the
    rows recorded in another run wherever it has one, so the sampler sees exactly those logits."""
    from tdpipe import LLM

    kw = {"num_kv_blocks": num_kv_blocks} if num_kv_blocks else {"kv_cache_memory": 256 << 20}
    llm = LLM(model=model, dtype=dtype, **kw)
    engine = llm.engine
    seen: dict[tuple[str, int], tuple[str, int]] = {}
    inner = engine._sample

    def recording(entries, logits):
        if replay is not None:
            logits = logits.clone()
        for i, (s, _) in enumerate(entries):
            key = (tuple(s.prompt_token_ids), len(s.output_token_ids))
            if replay is not None and key in replay:
                logits[i] = replay[key].to(logits.dtype)
            if keep is not None:
                keep[key] = logits[i].clone()
            row = logits[i].float().contiguous().numpy().tobytes()
            seen[(s.request_id, len(s.output_token_ids))] = (hashlib.sha1(row).hexdigest(), s.num_preemptions)
        return inner(entries, logits)

    engine._sample = recording
    try:
        outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
        preempted = engine.scheduler.num_preemptions
        engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()
    digests = {(int(rid) - int(outs[0].request_id), i): v for (rid, i), v in seen.items()}
    return [o.outputs[0].token_ids for o in outs], digests, preempted


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_tokens_survive_preemption(qwen2_tiny, dtype):
    """The same seeded requests with a cache that never runs out and with 12 blocks (~20 recompute
    preemptions, some requests preempted 3 times).

    Guaranteed: every position samples from the same random stream, so wherever a position's logits are
    bit-identical in both runs (and its prefix is), its token is too. Logits are not always bit-identical:
    a recomputed request's KV comes from a prefill (another attention path than decode), and it then
    decodes in batches of other sizes, whose CPU GEMMs round differently (fp32: MKL's 1-3 row kernels
    differ from 4+ rows; bf16: oneDNN's products differ by batch shape, now and then on AVX-512 and at
    nearly every position with AMX tiles). fp32: the ulps never move a temperature-1 draw here: every token
    matches. bf16: a request may go its own way from a position whose logits differ: that is numerics, not
    the sampler. So bf16 runs the preempting case with every position's logits replaced by the reference
    run's row for the same (prompt, position): the numerics are then the same by construction, and every
    token of every request must match, whatever the CPU's GEMM kernels do. (A bf16 preempting run without
    the replay proved nothing more than the fp32 one does, and took 20-40 s on CPUs without bf16 units.)"""
    replay: dict | None = {} if dtype == "bfloat16" else None
    ref, ref_logits, none = _run(qwen2_tiny[0], dtype, None, keep=replay)
    got, got_logits, preempted = _run(qwen2_tiny[0], dtype, 12, replay=replay)
    assert none == 0 and preempted > 0
    same_after_preemption = differing = 0
    for r, (a, b) in enumerate(zip(ref, got)):
        assert len(a) == len(b) == 48
        for i in range(48):
            if a[:i] != b[:i]:
                break  # other prefixes: nothing left to compare for this request
            (ha, _), (hb, n_pre) = ref_logits[(r, i)], got_logits[(r, i)]
            if ha != hb:
                differing += 1
                continue
            assert a[i] == b[i], f"request {r} position {i}: same logits, same stream, different token"
            same_after_preemption += n_pre > 0
    stats = (f"{preempted} preemptions; positions after a preemption with bit-identical logits: "
             f"{same_after_preemption}, positions with differing logits: {differing}; requests with "
             f"identical tokens: {sum(a == b for a, b in zip(ref, got))}/{len(ref)}")
    after = sum(n_pre > 0 for _, n_pre in got_logits.values())
    assert after >= 100, f"only {after} positions sampled after a preemption"  # not vacuous
    if replay is not None:
        assert all(got_logits[k][0] == ref_logits[k][0] for k in ref_logits)  # the replay did replace them
    assert got == ref, stats
