"""Tensor parallelism in the real runtime: the P x T layout, greedy parity with transformers at (P, T) =
(1, 2) and (2, 2), logits gathered by the engine from vocabulary shards, uneven head splits on the bundled
model, a killed tensor-parallel rank, and torchrun with T = 2.

The model-side sharding is tested without processes in test_tensor_parallel.py.
"""
import os
import signal
import threading
import time

import pytest
import torch
from conftest import hf_greedy
from procs import alive, stage_pids_of, torchrun_two_nodes

from tdpipe import LLM, SamplingParams
from tdpipe.pipeline.wire.layout import ENGINE, Layout
from tdpipe.pipeline.executor import PipelineError

N_OUT = 12
PROMPT_IDS = [[1, 2, 3, 4, 5], [9] * 3, list(range(100, 140)), [7, 300, 5000, 12, 44, 45, 46]]


def greedy(n=N_OUT):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def gen(llm, prompts=PROMPT_IDS, params=None):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params or greedy(), use_tqdm=False)


# ------------------------------------------------------------------------------------------- layout (unit)

def test_layout_numbering():
    lay = Layout(pp=3, tp=2)
    assert lay.world_size == 7 and lay.num_workers == 6
    assert [lay.rank(s, t) for s in range(3) for t in range(2)] == [1, 2, 3, 4, 5, 6]
    assert [lay.coords(r) for r in lay.worker_ranks()] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert lay.stage_ranks(1) == [3, 4] and lay.leaders() == [1, 3, 5]
    assert lay.prev_peer(1) is None and lay.prev_peer(4) == 2 and lay.prev_peer(6) == 4
    assert lay.next_peer(2) == 4 and lay.next_peer(5) == ENGINE and lay.next_peer(6) == ENGINE
    assert lay.result_ranks(greedy=True) == [5] and lay.result_ranks(greedy=False) == [5, 6]
    assert lay.is_first(2) and not lay.is_first(3) and lay.is_last(6) and not lay.is_last(4)
    assert lay.name(4) == "stage 1 tp rank 1" and Layout(2, 1).name(2) == "stage 1"


def test_layout_pp_only_matches_the_old_numbering():
    """T = 1 keeps the numbering the pipeline always had: stage k is rank k + 1, feeding rank k + 2."""
    lay = Layout(pp=4)
    for k in range(4):
        r = lay.rank(k)
        assert r == k + 1 and lay.next_peer(r) == (ENGINE if k == 3 else k + 2)


@pytest.mark.parametrize("pp,tp", [(0, 1), (1, 0), (2, -1), (1, 2.0), (True, 1)])
def test_layout_rejects_bad_sizes(pp, tp):
    with pytest.raises(ValueError, match="parallel_size must be an integer >= 1"):
        Layout(pp, tp)


def test_layout_rejects_foreign_ranks():
    lay = Layout(2, 2)
    with pytest.raises(ValueError, match="rank 5 is not a worker"):
        lay.coords(5)
    with pytest.raises(ValueError, match="rank 0 is not a worker"):
        lay.coords(0)
    with pytest.raises(ValueError, match=r"no worker \(stage 2, tp rank 0\)"):
        lay.rank(2, 0)


def test_parallel_config_rejects_bad_tp():
    from tdpipe.config import ParallelConfig

    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        ParallelConfig(tensor_parallel_size=0)
    assert ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=3).world_size == 6


# ------------------------------------------------------------------------------------------- models

@pytest.fixture(scope="module")
def llama_tied_folder(tmp_path_factory, bundled_path):
    """Random Llama with tied embeddings (the lm_head shard comes from the embedding's rows), 8 query /
    2 KV heads, an odd intermediate size (uneven MLP shards) and 4 layers (2 per stage at pp 2)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("llamatp")
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=97, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, initializer_range=0.1, eos_token_id=2, bos_token_id=1)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{bundled_path}/{f}", d / f)
    return str(d), model


def _oracle(model):
    return [hf_greedy(model, p, N_OUT) for p in PROMPT_IDS]


@pytest.mark.parametrize("pp,tp", [(1, 2), (2, 2)])
@pytest.mark.parametrize("which", ["qwen2_tiny", "llama_tied_folder"], ids=["qwen2", "llama_tied"])
def test_greedy_parity_with_transformers(request, which, pp, tp):
    folder, model = request.getfixturevalue(which)
    ref = _oracle(model)
    with LLM(folder, dtype="float32", kv_cache_memory=32 << 20, pipeline_parallel_size=pp,
             tensor_parallel_size=tp, threads_per_stage=1) as llm:
        ex = llm.engine.executor
        assert ex.layout == Layout(pp, tp) and len(ex.stage_pids) == pp * tp
        assert tokens(gen(llm)) == ref


def test_logits_from_vocab_shards_match_tp1(qwen2_tiny):
    """Non-greedy rows: every last-stage rank returns its vocabulary shard and the engine concatenates them;
    logprobs (and so the whole distribution) agree with T = 1 to float32 rounding."""
    folder, _ = qwen2_tiny
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4)
    with LLM(folder, dtype="float32", kv_cache_memory=32 << 20) as one:
        ref = gen(one, params=params)
    with LLM(folder, dtype="float32", kv_cache_memory=32 << 20, tensor_parallel_size=2,
             threads_per_stage=1) as two:
        got = gen(two, params=params)
    assert tokens(got) == tokens(ref)
    for a, b in zip(got, ref):
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            for k in pa:
                assert abs(pa[k].logprob - pb[k].logprob) < 1e-4 and pa[k].rank == pb[k].rank


def test_bundled_model_uneven_heads(llm_fp32):
    """SmolLM2 has 9 query / 3 KV heads: T = 2 splits them 2 + 1 KV heads (6 + 3 query heads) and still
    matches T = 1; T = 4 cannot give every rank a KV head and fails before any worker starts."""
    ref = tokens(gen(llm_fp32))
    with LLM(dtype="float32", kv_cache_memory=64 << 20, tensor_parallel_size=2, threads_per_stage=1) as llm:
        assert tokens(gen(llm)) == ref
    before = set(stage_pids_of(os.getpid()))
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 .*3 KV heads"):
        LLM(dtype="float32", kv_cache_memory=64 << 20, tensor_parallel_size=4)
    assert set(stage_pids_of(os.getpid())) <= before


# ------------------------------------------------------------------------------------------- faults

@pytest.mark.faults
def test_killed_tp_rank_names_the_rank(qwen2_tiny):
    """SIGKILL of stage 1's tp rank 1 mid-run: generate() raises PipelineError naming that rank and its pid
    within seconds, and no worker process is left."""
    folder, _ = qwen2_tiny
    before = set(stage_pids_of(os.getpid()))
    llm = LLM(folder, dtype="float32", kv_cache_memory=32 << 20, pipeline_parallel_size=2,
              tensor_parallel_size=2, threads_per_stage=1)
    try:
        ex = llm.engine.executor
        victim = ex.layout.rank(1, 1)  # worker rank 4
        pid = ex.procs[victim - 1].pid
        killed: list[float] = []
        timer = threading.Timer(0.5, lambda: (killed.append(time.time()), os.kill(pid, signal.SIGKILL)))
        timer.start()
        try:
            with pytest.raises(PipelineError) as e:
                gen(llm, [[5 + i] * 8 for i in range(16)], greedy(400))
        finally:
            timer.cancel()
        assert killed, "generate() ended before the rank was killed"
        assert time.time() - killed[0] < 10
        msg = str(e.value)
        assert "stage 1 tp rank 1" in msg and f"rank {victim}" in msg and str(pid) in msg and "signal 9" in msg
        procs = list(ex.procs)
    finally:
        llm.shutdown()
    deadline = time.time() + 5
    while any(alive(p.pid) for p in procs) and time.time() < deadline:
        time.sleep(0.05)
    assert not [p.pid for p in procs if alive(p.pid)]
    assert set(stage_pids_of(os.getpid())) <= before


# ------------------------------------------------------------------------------------------- torchrun

TORCHRUN_SCRIPT = """
import json, os
from tdpipe import LLM, SamplingParams
llm = LLM({folder!r}, dtype="float32", kv_cache_memory=32 << 20, tensor_parallel_size=2, threads_per_stage=1)
# only rank 0 (the engine) gets here: ranks 1 and 2 served their tensor-parallel shard inside LLM()
ex = llm.engine.executor
outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}],
                    SamplingParams(temperature=0, max_tokens={n}, ignore_eos=True), use_tqdm=False)
print("TOKENS " + json.dumps({{"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
                              "launcher": ex.launcher, "stage_pids": ex.stage_pids,
                              "tokens": [o.outputs[0].token_ids for o in outs]}}), flush=True)
llm.shutdown()
"""


def test_torchrun_tensor_parallel_two_nodes(tmp_path, qwen2_tiny):
    """Engine + tp rank 0 on "node" 0, tp rank 1 on "node" 1 (loopback): world size 3 = 1 + P x T; the
    tensor-parallel group spans the two nodes."""
    folder, model = qwen2_tiny
    ref = _oracle(model)[:2]
    script = tmp_path / "run_tp.py"
    script.write_text(TORCHRUN_SCRIPT.format(folder=folder, prompts=PROMPT_IDS[:2], n=N_OUT))
    res, out1 = torchrun_two_nodes(script, tmp_path)
    assert res["rank"] == 0 and res["world"] == 3 and res["launcher"] == "torchrun"
    assert len(res["stage_pids"]) == 2
    assert res["tokens"] == ref
    assert "TOKENS" not in out1
