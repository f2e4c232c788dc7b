"""Prefix caching inside the policies (no model): admission, gLLM's #WP (Eq. 3) and TD-Pipe's predicted KV
(Algorithm 1) count only what a request will really prefill and allocate."""
from tdpipe.core.block_manager import BlockManager
from tdpipe.core.sample_group import SampleGroup
from tdpipe.core.scheduler import make_scheduler
from tdpipe.core.scheduler.registry import scheduler_config
from tdpipe.predictor.base import OraclePredictor
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence

BS = 16
PREFIX = list(range(100, 100 + 10 * BS))  # 10 full blocks


def seq(i: int, prompt: list[int], out: int = 4, **sp) -> Sequence:
    return Sequence(i, str(i), prompt, SamplingParams(max_tokens=out, **sp), max_tokens=out)


def make(policy: str, caching: bool = True, num_blocks: int = 200, **kw):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    cfg = scheduler_config(policy=policy, max_num_seqs=64, max_model_len=4096, **kw)
    extra = {"predictor": OraclePredictor()} if policy == "td-pipe" else {}
    return make_scheduler(cfg, bm, **extra), bm


def prefill(sched, s: Sequence) -> None:
    """Run batches (each returns at once, one token per sampled row; the blocks it computed are named) until
    `s` has its first token (throttle prefills in chunks)."""
    sched.add(s)
    while not s.output_token_ids:
        b = sched.schedule()
        sched.update_from_output(b, [7] * len(b.sampled_rows()))


def test_second_request_prefills_only_its_suffix():
    for policy in ("separate", "hybrid", "throttle", "td-pipe"):
        sched, bm = make(policy)
        prefill(sched, seq(0, PREFIX + [1, 2, 3]))
        sched.add(seq(1, PREFIX + [4, 5, 6, 7]))
        b = sched.schedule()
        s1 = next((s for s in b.seqs if s.seq_id == 1), None)
        if s1 is None:  # throttle: decodes first; the next batch takes the new prompt
            sched.update_from_output(b, [7] * len(b.sampled_rows()))
            b = sched.schedule()
            s1 = next(s for s in b.seqs if s.seq_id == 1)
        n1 = b.num_new_tokens[b.seqs.index(s1)]
        assert s1.num_cached_tokens == 10 * BS and n1 == 4, policy
        assert s1.block_table[:10] == sched.running[0].block_table[:10]  # the same physical blocks


def test_throttle_wp_excludes_cached_prefix():
    sched, bm = make("throttle")
    prefill(sched, seq(0, PREFIX + [1]))
    for i in range(1, 9):
        sched.add(seq(i, PREFIX + [i] * 8))
    assert sched.waiting_prefill_tokens() == 8 * 8  # not 8 * 168
    off, _ = make("throttle", caching=False)
    for i in range(1, 9):
        off.add(seq(i, PREFIX + [i] * 8))
    assert off.waiting_prefill_tokens() == 8 * 168


def test_td_pipe_predicted_kv_counts_shared_blocks_once():
    sched, bm = make("td-pipe", future_points=(32, 64))
    first = seq(0, PREFIX + [1], out=64, ignore_eos=True)
    prefill(sched, first)
    later = seq(1, PREFIX + [2], out=64, ignore_eos=True)
    fresh = seq(2, list(range(5000, 5000 + 161)), out=64, ignore_eos=True)
    shared, own = sched.seq_usage(later), sched.seq_usage(fresh)
    assert [o - s for o, s in zip(own, shared)] == [10, 10]  # its 10 cached blocks are not its own
    plan = sched.prefill_plan(later)
    assert plan.num_cached_tokens == 10 * BS and plan.num_new_blocks == 1  # 161 tokens: 11 blocks


def test_forking_parent_counts_its_samples():
    sched, bm = make("separate", max_num_batched_tokens=8192)
    p = seq(0, [1] * 40, out=8, n=4, temperature=1.0)
    SampleGroup(p)  # 3 samples to fork once its prompt is prefilled
    sched.config.max_num_seqs = 6
    q = seq(1, [2] * 40, out=8, n=4, temperature=1.0)
    SampleGroup(q)
    sched.add(p)
    sched.add(q)
    b = sched.schedule()
    assert b.seqs == [p]  # 4 + 4 samples exceed max_num_seqs = 6


def test_prompt_logprobs_requests_skip_the_cache():
    sched, bm = make("separate")
    prefill(sched, seq(0, PREFIX + [1]))
    s = seq(1, PREFIX + [2], prompt_logprobs=1)
    sched.add(s)
    b = sched.schedule()
    assert s in b.seqs and s.num_cached_tokens == 0 and b.num_new_tokens[b.seqs.index(s)] == len(PREFIX) + 1
