"""The pipeline-parallel runtime end to end: stage worker processes over torch.distributed (gloo).

Greedy float32 tokens must not depend on pp (1, 2, 3), on preemption or on the batching policy, and must
equal transformers'; traces must describe every micro-batch on every stage; a dead stage must fail
generate() quickly with a clear PipelineError and leave no process behind; torchrun launches across two
"nodes" on loopback; bad --layer-partition values are rejected before anything starts.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import hf_greedy
from procs import alive, broken_model_copy, stage_pids_of, torchrun_two_nodes

from tdpipe import LLM, SamplingParams
from tdpipe.pipeline import zygote
from tdpipe.pipeline.executor import PipelineError
from tdpipe.pipeline.zygote import ZygoteStage
from tdpipe.sampling.bad_words import bad_words_token_ids
from tdpipe.viz import timeline as tl

PROMPTS = [
    "The capital of France is",
    "Hi",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a land far away, there lived a young girl who loved to read books. One day she",
]
N_OUT = 16


def greedy(n=N_OUT):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_all_exited(procs, within=5.0):
    """Every stage process has exited (and was reaped) within `within` seconds: no orphans."""
    deadline = time.time() + within
    for p in procs:
        try:
            p.wait(timeout=max(0.01, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"stage process {p.pid} still running {within} s after shutdown / failure")
        assert p.returncode is not None
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def hf_ref(hf_fp32, llm_fp32):
    """transformers' greedy continuation of every prompt (the oracle)."""
    tok = llm_fp32.get_tokenizer()
    return [hf_greedy(hf_fp32, tok.encode(p), N_OUT) for p in PROMPTS]


@pytest.fixture(scope="module")
def pp1_tokens(llm_fp32, hf_ref):
    out = tokens(llm_fp32.generate(PROMPTS, greedy(), use_tqdm=False))
    assert out == hf_ref
    return out


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return str(tmp_path_factory.mktemp("trace") / "trace.json")


@pytest.fixture(scope="module")
def llm_pp2(trace_file):
    with LLM(dtype="float32", kv_cache_memory=64 << 20, pipeline_parallel_size=2, trace=trace_file) as llm:
        procs = llm.engine.executor.procs  # shutdown() drops the executor
        yield llm
    assert_all_exited(procs)


# --------------------------------------------------------------------------------------------- parity


def test_pp2_matches_pp1_and_hf(llm_pp2, pp1_tokens, hf_ref):
    ex = llm_pp2.engine.executor
    assert ex.num_stages == 2 and ex.launcher == "spawn" and len(ex.procs) == 2
    assert all(p.poll() is None for p in ex.procs)
    assert ex.stage_pids == [p.pid for p in ex.procs]
    # this process is not blank: its stages come from its zygote (pipeline/zygote.py), where torch has no CUDA
    assert all(isinstance(p, ZygoteStage if zygote.usable() else subprocess.Popen) for p in ex.procs)
    tok = llm_pp2.get_tokenizer()
    assert len({len(tok.encode(p)) for p in PROMPTS}) == len(PROMPTS)  # all different lengths
    outs = llm_pp2.generate(PROMPTS, greedy(), use_tqdm=False)
    assert tokens(outs) == pp1_tokens == hf_ref
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    llm_pp2.engine.block_manager.check_no_leaks()
    # a second call on the same stages (block tables of finished sequences were dropped) still matches
    assert tokens(llm_pp2.generate(PROMPTS[::-1], greedy(), use_tqdm=False)) == pp1_tokens[::-1]
    assert len(ex.sender) == 0


def test_pp3_matches_pp1_and_hf(pp1_tokens, hf_ref, monkeypatch):
    monkeypatch.setenv("TDPIPE_PREFORK", "0")  # spawned stages: fresh interpreters, the path CUDA builds take
    with LLM(dtype="float32", kv_cache_memory=64 << 20, pipeline_parallel_size=3) as llm:
        parts = llm.engine.partition
        assert len(parts) == 3 and parts[0][0] == 0 and parts[-1][1] == 30
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert tokens(outs) == pp1_tokens == hf_ref
        procs = llm.engine.executor.procs
    assert_all_exited(procs)
    assert [p.returncode for p in procs] == [0, 0, 0]  # stopped by STOP, not killed
    assert all(isinstance(p, subprocess.Popen) for p in procs)


# The policy tests below run the random 3-layer Qwen2 (fixtures further down; it starts and steps in a
# fraction of the bundled model's time): what they check is that neither the batching policy, nor chunking,
# nor preemption at pp 1 and 2 changes transformers' greedy tokens.


def test_pp2_under_preemption(qwen2_tiny, qwen2_prompts, qwen2_ref):
    # 8 blocks x 16 tokens = 128 slots for 6 sequences of 17..80 tokens: recompute preemption must happen
    with LLM(model=qwen2_tiny[0], dtype="float32", num_kv_blocks=8, pipeline_parallel_size=2,
             layer_partition=[2, 1]) as llm:
        assert llm.engine.partition == [(0, 2), (2, 3)]
        outs = llm.generate(qwen2_prompts, greedy(), use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert tokens(outs) == qwen2_ref
        assert any(o.metrics.num_preemptions > 0 for o in outs)
        llm.engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("pp", [1, 2])
def test_logit_bias_rows_leave_the_stage_argmax(pp, qwen2_tiny, qwen2_prompts, qwen2_ref):
    """A greedy row with a logit bias cannot take the last stage's argmax (SiPipe §5.1's ids-only result):
    +100 on a token makes every output that token, a -100 on each reference token moves the answer, and the
    unbiased rows of the same batches keep transformers' tokens."""
    forced, banned = 1234, qwen2_ref[1][0]
    params = [greedy()] * len(qwen2_prompts)
    params[0] = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, logit_bias={forced: 100.0})
    params[1] = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, logit_bias={banned: -100.0})
    with LLM(model=qwen2_tiny[0], dtype="float32", kv_cache_memory=32 << 20, pipeline_parallel_size=pp) as llm:
        outs = tokens(llm.generate(qwen2_prompts, params, use_tqdm=False))
    assert outs[0] == [forced] * N_OUT
    assert banned not in outs[1] and outs[1] != qwen2_ref[1]
    assert outs[2:] == qwen2_ref[2:]


def _word_of(tok, t: int) -> str | None:
    """The text of token t when bad_words bans exactly it (vLLM's spellings: the word, and after a space only
    if that is as many tokens as the word alone); None otherwise."""
    word = tok.decode([t]).strip()
    spellings = bad_words_token_ids([word], lambda x: tok.encode(x, add_special_tokens=False)) if word else []
    return word if [t] in spellings else None


@pytest.mark.parametrize("pp", [1, 2])
def test_bad_words_and_prompt_truncation(pp, qwen2_tiny, qwen2_prompts, qwen2_ref):
    """vLLM's bad_words: a one-token word never appears in the answer (which then leaves transformers' greedy
    path), a two-token word's second token never follows its first; the rows without them keep transformers'
    tokens in the same batches. truncate_prompt_tokens=k runs the prompt's last k tokens: the answer of that
    shorter prompt, with the prompt ids it ran reported."""
    with LLM(model=qwen2_tiny[0], dtype="float32", kv_cache_memory=32 << 20, pipeline_parallel_size=pp) as llm:
        tok = llm.get_tokenizer()
        at, one = next((i, w) for i, w in enumerate(_word_of(tok, t) for t in qwen2_ref[1]) if w is not None)
        pair = qwen2_ref[3][:2]
        two = tok.decode(pair)
        assert tok.encode(two, add_special_tokens=False) == pair or \
            tok.encode(" " + two.lstrip(), add_special_tokens=False) == pair
        params = [greedy()] * len(qwen2_prompts)
        params[1] = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, bad_words=[one])
        params[3] = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, bad_words=[two])
        params[5] = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, truncate_prompt_tokens=7)
        outs = llm.generate(qwen2_prompts, params, use_tqdm=False)
        short = llm.generate([qwen2_prompts[5][-7:]], greedy(), use_tqdm=False)[0]
    got = tokens(outs)
    assert qwen2_ref[1][at] not in got[1] and got[1][:at] == qwen2_ref[1][:at] and got[1] != qwen2_ref[1]
    assert all(got[3][i:i + 2] != pair for i in range(len(got[3]) - 1)) and got[3] != qwen2_ref[3]
    assert outs[5].prompt_token_ids == qwen2_prompts[5][-7:] and got[5] == short.outputs[0].token_ids
    assert got[5] != qwen2_ref[5]
    assert [got[i] for i in (0, 2, 4)] == [qwen2_ref[i] for i in (0, 2, 4)]


@pytest.mark.parametrize("pp", [1, 2])
def test_hybrid_small_budget(pp, qwen2_tiny, qwen2_prompts, qwen2_ref):
    # 16 tokens per micro-batch: the longer prompts are prefilled in chunks, decodes mixed in
    with LLM(model=qwen2_tiny[0], dtype="float32", kv_cache_memory=32 << 20, scheduler="hybrid",
             max_num_batched_tokens=16, pipeline_parallel_size=pp) as llm:
        outs = llm.generate(qwen2_prompts, greedy(), use_tqdm=False)
        assert tokens(outs) == qwen2_ref
        assert llm.engine.stats.mixed_steps > 0
        llm.engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("pp", [1, 2])
def test_prompts_over_the_budget_run_whole(pp, qwen2_tiny, qwen2_prompts, qwen2_ref):
    # separate never chunks: prompts longer than the 8-token budget are prefilled alone through the stages
    with LLM(model=qwen2_tiny[0], dtype="float32", kv_cache_memory=32 << 20, scheduler="separate",
             max_num_batched_tokens=8, pipeline_parallel_size=pp) as llm:
        outs = llm.generate(qwen2_prompts, greedy(), use_tqdm=False)
        assert tokens(outs) == qwen2_ref
        assert llm.engine.scheduler.config.max_num_batched_tokens == 8
        assert max(len(o.prompt_token_ids) for o in outs) > 8
        llm.engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("pp", [1, 2])
def test_td_pipe_phases(pp, qwen2_tiny, qwen2_prompts, qwen2_ref):
    # TD-Pipe with small prefill batches and a tight KV cache: phases switch, tokens stay identical
    with LLM(model=qwen2_tiny[0], dtype="float32", num_kv_blocks=12, scheduler="td-pipe",
             max_num_batched_tokens=32, future_points=(4, 64), pipeline_parallel_size=pp) as llm:
        outs = llm.generate(qwen2_prompts, greedy(), use_tqdm=False)
        assert tokens(outs) == qwen2_ref
        assert llm.engine.scheduler.num_switches >= 1
        llm.engine.block_manager.check_no_leaks()


@pytest.mark.slow
def test_td_pipe_profiles_step_costs_on_the_executor_once(tmp_path, monkeypatch):
    """Eq. 1-2 run on costs measured through the real stages at start-up; the second start reads the cache."""
    monkeypatch.setattr("tdpipe.core.step_profile.cache_dir", lambda: tmp_path)
    with LLM(dtype="float32", kv_cache_memory=64 << 20, scheduler="td-pipe", pipeline_parallel_size=2,
             layer_partition=[16, 14]) as llm:  # pinned: the measured split is noisy and keys the profile
        costs = llm.engine.scheduler.costs
        assert costs.source == "profile"
        dec, pre = costs.points["decode"], costs.points["prefill"]
        assert len(dec) >= 3 and len(pre) >= 3 and costs.peak_batch == dec[-1][0]
        assert costs.p1 > 0 and pre[-1][1] > pre[0][1]  # prefill is compute-bound: more tokens take longer
        # decode of at most 11 sequences reads the weights once whatever the batch (memory-bound on a CPU):
        # its fitted slope is noise around 0, clamped to >= 0 (a CI run fitted 0.0)
        assert costs.d0 > 0 and costs.d1 >= 0 and all(t > 0 for _, t in dec)
        llm.engine.block_manager.check_no_leaks()  # the dummy requests gave their KV back
        outs = llm.generate(PROMPTS[:2], greedy(), use_tqdm=False)
        assert all(o.outputs[0].token_ids for o in outs)
    files = list(tmp_path.glob("step-*.json"))
    assert len(files) == 1
    with LLM(dtype="float32", kv_cache_memory=64 << 20, scheduler="td-pipe", pipeline_parallel_size=2,
             layer_partition=[16, 14]) as llm:  # pinned: the measured split is noisy and keys the profile
        again = llm.engine.scheduler.costs
        assert again.source == str(files[0]) and again.d1 == costs.d1 and again.p1 == costs.p1
    with LLM(dtype="float32", kv_cache_memory=64 << 20, scheduler="td-pipe",
             switch_to_prefill="finish-ratio:0.5") as llm:
        assert llm.engine.scheduler.costs.source == "default"  # the ablation needs no profile


@pytest.mark.parametrize("pp", [1, 2])
def test_throttle_small_prefill_budget(pp, qwen2_tiny, qwen2_prompts, qwen2_ref):
    # gLLM Token Throttling with #MaxP = 16, #MinP = 4: prompts arrive in Eq. 3-sized chunks
    with LLM(model=qwen2_tiny[0], dtype="float32", kv_cache_memory=32 << 20, scheduler="throttle",
             max_prefill_tokens=16, min_prefill_tokens=4, throttle_T=2.0, pipeline_parallel_size=pp) as llm:
        outs = llm.generate(qwen2_prompts, greedy(), use_tqdm=False)
        assert tokens(outs) == qwen2_ref
        assert llm.engine.stats.mixed_steps > 0
        llm.engine.block_manager.check_no_leaks()


# --------------------------------------------------------------------------------------------- random Qwen2


@pytest.fixture(scope="module")
def qwen2_prompts():
    rng = torch.Generator().manual_seed(1)
    return [torch.randint(100, 49152, (n,), generator=rng).tolist() for n in (3, 17, 1, 40, 9, 64)]


@pytest.fixture(scope="module")
def qwen2_ref(qwen2_tiny, qwen2_prompts):
    _, hf = qwen2_tiny
    return [hf_greedy(hf, p, N_OUT) for p in qwen2_prompts]


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_random_qwen2(pp, qwen2_tiny, qwen2_prompts, qwen2_ref):
    path, _ = qwen2_tiny
    llm = LLM(model=path, dtype="float32", kv_cache_memory=32 << 20, pipeline_parallel_size=pp)
    try:
        counts = [b - a for a, b in llm.engine.partition]
        assert len(counts) == pp and sum(counts) == 3 and min(counts) >= 1
        assert tokens(llm.generate(qwen2_prompts, greedy(), use_tqdm=False)) == qwen2_ref
        procs = list(getattr(llm.engine.executor, "procs", []))
        assert len(procs) == (0 if pp == 1 else pp)
    finally:
        llm.shutdown()
    # shutdown leaves nothing behind, promptly, and the stages stopped cleanly (not killed); a second
    # shutdown is harmless
    assert_all_exited(procs, within=5.0)
    assert [p.returncode for p in procs] == [0] * len(procs)
    llm.shutdown()


def test_pp_exceeding_layers_fails_before_spawning(qwen2_tiny):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(4\).*3 layers"):
        LLM(model=qwen2_tiny[0], dtype="float32", kv_cache_memory=32 << 20, pipeline_parallel_size=4)


# --------------------------------------------------------------------------------------------- trace


def test_trace_file(llm_pp2, trace_file):
    if os.path.exists(trace_file):
        os.remove(trace_file)
    hits = llm_pp2.engine.block_manager.prefix_cache_hits  # earlier tests ran these prompts: cached blocks
    llm_pp2.generate(PROMPTS, greedy(8), use_tqdm=False)
    hits = llm_pp2.engine.block_manager.prefix_cache_hits - hits
    trace = tl.load_trace(trace_file)  # written by generate(), and valid
    assert trace == json.loads(json.dumps(llm_pp2.trace()))  # the same as the API's (no new events since)
    assert trace["format"] == "tdpipe-trace/1" and trace["pp"] == 2 and trace["policy"] == "separate"
    stages = trace["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    # layer ranges: contiguous, covering every layer once
    assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == 30
    assert stages[0]["layers"][1] == stages[1]["layers"][0]
    assert all(s["layers"][0] < s["layers"][1] for s in stages)
    # the default lm_head split (auto) may give stage 0 an extra "head" event per micro-batch: its part of it
    heads = [e for e in stages[0]["events"] if e.get("head")]
    assert sorted(e["batch_id"] for e in heads) in ([], sorted(e["batch_id"] for e in stages[1]["events"]))
    assert (llm_pp2.engine.lm_head_split > 0) == bool(heads)
    ids = [[e["batch_id"] for e in s["events"] if not e.get("head")] for s in stages]
    assert ids[0] and sorted(ids[0]) == sorted(ids[1]), ids  # every micro-batch ran on both stages
    assert len(set(ids[0])) == len(ids[0])
    assert sorted(ids[0]) == sorted(e["batch_id"] for e in trace["engine"])
    for s in stages:
        for e in s["events"]:
            assert 0 <= e["start"] <= e["end"], e
            assert e["wait"] >= 0 and e["send"] >= 0
    # a micro-batch computes on stage 1 after stage 0 finished it
    ends0 = {e["batch_id"]: e["end"] for e in stages[0]["events"] if not e.get("head")}
    assert all(e["start"] >= ends0[e["batch_id"]] - 1e-3 for e in stages[1]["events"])
    # shapes: 6 prompts prefilled (less what the prefix cache held), then decode batches
    assert sum(e["prefill_tokens"] for e in stages[0]["events"]) == sum(
        len(llm_pp2.get_tokenizer().encode(p)) for p in PROMPTS) - hits
    assert any(e["decode_seqs"] > 0 for e in stages[0]["events"])
    s = tl.summarize(trace)
    assert len(s["bubble_ratio_per_stage"]) == 2
    assert all(0.0 <= r <= 1.0 for r in s["bubble_ratio_per_stage"])
    assert 0.0 <= s["bubble_ratio"] <= 1.0
    assert s["num_micro_batches"] == [len(ids[0])] * 2
    kv = trace["kv"]
    assert len(kv) >= 2 and all(0.0 <= f <= 1.0 for _, f in kv) and max(f for _, f in kv) > 0


# --------------------------------------------------------------------------------------------- failures


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_killed_stage_fails_generate(victim):
    llm = LLM(dtype="float32", kv_cache_memory=256 << 20, pipeline_parallel_size=2)
    procs = list(llm.engine.executor.procs)
    pid = llm.engine.executor.stage_pids[victim]
    assert pid == procs[victim].pid
    killed_at = []

    def kill():
        killed_at.append(time.time())
        os.kill(pid, signal.SIGKILL)

    def guard():  # should the engine not notice, stop everything so the test fails instead of hanging
        for p in procs:
            if p.poll() is None:
                p.kill()

    timer, guard_timer = threading.Timer(2.0, kill), threading.Timer(25.0, guard)
    try:
        prompts = [f"Story number {i}: once upon a time" for i in range(64)]
        timer.start()
        guard_timer.start()
        with pytest.raises(PipelineError) as e:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
                         use_tqdm=False)
        failed_at = time.time()
        assert killed_at, "generate() failed before the stage was killed"
        assert failed_at - killed_at[0] < 15.0, failed_at - killed_at[0]
        msg = str(e.value)
        assert f"stage {victim}" in msg and str(pid) in msg and "signal 9" in msg, msg
        assert "requests did not finish" in msg
        assert isinstance(e.value, RuntimeError)
        # every stage is gone, the killed one and the one the watchdog stopped
        assert_all_exited(procs, within=5.0)
        # the engine stays failed: a later call raises at once instead of hanging
        t0 = time.time()
        with pytest.raises(PipelineError):
            llm.generate("Hi", greedy(2), use_tqdm=False)
        assert time.time() - t0 < 5.0
    finally:
        timer.cancel()
        guard_timer.cancel()
        llm.shutdown()
    assert_all_exited(procs, within=1.0)


def test_stage_that_raises_at_startup_fails_cleanly(qwen2_tiny, tmp_path):
    """A stage whose weights are incomplete raises while loading: the engine reports the stage's error and
    leaves no process behind."""
    broken = broken_model_copy(qwen2_tiny[0], tmp_path / "broken")
    before = set(stage_pids_of(os.getpid()))  # stages of other engines this test process holds
    t0 = time.time()
    with pytest.raises(PipelineError, match=r"stage 1 failed to start.*missing tensors"):
        LLM(model=str(broken), dtype="float32", kv_cache_memory=32 << 20, pipeline_parallel_size=2,
            layer_partition=[2, 1])
    assert time.time() - t0 < 60
    time.sleep(0.5)
    left = [pid for pid in set(stage_pids_of(os.getpid())) - before if alive(pid)]
    assert not left, f"stage processes left behind: {left}"


ENGINE_SCRIPT = """
import sys, time
from tdpipe import LLM
llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_memory=32 << 20, pipeline_parallel_size=2)
print(" ".join(str(p.pid) for p in llm.engine.executor.procs), flush=True)
time.sleep(600)
"""


def test_killed_engine_takes_its_stages_along(qwen2_tiny, tmp_path):
    """No orphans even when the engine itself is SIGKILLed (each stage watches the engine's pidfd)."""
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    eng = subprocess.Popen([sys.executable, str(script), qwen2_tiny[0]], stdout=subprocess.PIPE, text=True)
    try:
        line = eng.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2, line
        eng.kill()
        eng.wait(timeout=10)
        deadline = time.time() + 10
        left = pids
        while left and time.time() < deadline:
            left = [p for p in pids if alive(p)]
            time.sleep(0.1)
        assert not left, f"stages {left} outlived the engine"
    finally:
        if eng.poll() is None:
            eng.kill()


# --------------------------------------------------------------------------------------------- torchrun

TORCHRUN_SCRIPT = """
import json, os
from tdpipe import LLM, SamplingParams
prompts = {prompts!r}
llm = LLM(dtype="float32", kv_cache_memory=64 << 20, pipeline_parallel_size=2)
# only rank 0 (the engine) gets here: ranks 1 and 2 served a stage inside LLM() and exited
ex = llm.engine.executor
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens={n}, ignore_eos=True), use_tqdm=False)
print("TOKENS " + json.dumps({{"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
                              "launcher": ex.launcher, "stage_pids": ex.stage_pids,
                              "tokens": [o.outputs[0].token_ids for o in outs]}}), flush=True)
llm.shutdown()
"""


def test_torchrun_two_nodes_loopback(tmp_path, pp1_tokens):
    """Engine + stage 0 on "node" 0 (2 processes), stage 1 on "node" 1 (1 process): world size 3 = pp + 1.
    torchrun's static rendezvous accepts a different --nproc-per-node on each node."""
    script = tmp_path / "run_pp.py"
    script.write_text(TORCHRUN_SCRIPT.format(prompts=PROMPTS[:3], n=N_OUT))
    res, out1 = torchrun_two_nodes(script, tmp_path)
    assert res["rank"] == 0 and res["world"] == 3 and res["launcher"] == "torchrun"
    assert len(res["stage_pids"]) == 2
    assert res["tokens"] == pp1_tokens[:3]
    assert "TOKENS" not in out1  # node 1 only ran a stage


# --------------------------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_layer_partition_wrong_sum(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "tdpipe")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "tdpipe.cli"]
    args = ["generate", "hello", "--pp", "2", "--layer-partition", "20,5", "--dtype", "float32",
            "--kv-cache-memory", "64MiB", "--max-tokens", "2", "--no-progress"]
    r = subprocess.run(cmd + args, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0
    assert "layer_partition" in r.stderr and "[20, 5]" in r.stderr and "25" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_cli_layer_partition_bad_values(capsys):
    from tdpipe.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "hello", "--pp", "2", "--layer-partition", "a,b"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--layer-partition" in err and "a,b" in err
    with pytest.raises(SystemExit) as e:
        main(["generate", "hello", "--pp", "2", "--layer-partition", "30,0"])
    assert e.value.code == 2
    assert "at least one layer" in capsys.readouterr().err
    # three entries for two stages: rejected by the config, before the model loads
    assert main(["generate", "hello", "--pp", "2", "--layer-partition", "10,10,10"]) == 2
    err = capsys.readouterr().err
    assert "layer_partition" in err and "3 entries" in err
