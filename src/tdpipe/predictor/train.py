"""Training and evaluation of the length predictor on a recorded history (TD-Pipe §4.4.1, Figure 14).

The history is split 60/20/20 (train / validation / test) with a fixed seed; the encoder is frozen, so each
prompt is embedded once and only the head trains (Adam, cross-entropy, early stopping on validation loss).
Evaluation reports the per-request bucket accuracy and the accumulated error of the *total* predicted
length over groups of 1, 2, 4, ..., 512 requests, |sum(pred) - sum(true)| / sum(true), the quantity that
Algorithm 1's KV simulation depends on, beside the constant-mean baseline.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tdpipe.predictor.history import HistoryRecord
from tdpipe.predictor.model import DEFAULT_PERCENTILES, Buckets, LearnedPredictor, LengthHead, PredictorMeta

GROUP_SIZES = tuple(2 ** i for i in range(10))  # 1 .. 512 (Figure 14)


def split(records: list[HistoryRecord], seed: int = 0) -> tuple[list[HistoryRecord], ...]:
    """60 / 20 / 20, shuffled with `seed`."""
    idx = list(range(len(records)))
    random.Random(seed).shuffle(idx)
    a, b = int(0.6 * len(idx)), int(0.8 * len(idx))
    if a == 0 or b == a or b == len(idx):
        raise ValueError(f"a history of {len(records)} records is too small to split 60/20/20")
    return tuple([records[i] for i in part] for part in (idx[:a], idx[a:b], idx[b:]))


@dataclass
class TrainConfig:
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    hidden: int = 256
    epochs: int = 400
    lr: float = 2e-3
    weight_decay: float = 1e-4
    patience: int = 40
    seed: int = 0
    max_length: int = 256
    encoder_dtype: str | None = None  # None: bfloat16 where the CPU has bf16 instructions (encoder.default_dtype)
    estimate: str = "calibrated"  # PredictorMeta.estimate
    min_calibration: int = 5  # fewer validation requests in a predicted bucket: keep its training mean


def train(records: list[HistoryRecord], cfg: TrainConfig, encoder=None, history_name: str = "",
          log=print) -> LearnedPredictor:
    from tdpipe.predictor.encoder import SentenceEncoder, default_dtype

    enc = encoder or SentenceEncoder(max_length=cfg.max_length, dtype=cfg.encoder_dtype or default_dtype())
    tr, va, _ = split(records, cfg.seed)
    buckets = Buckets.fit([r.output_tokens for r in tr], cfg.percentiles)
    xs = {n: enc.encode([r.prompt for r in part]) for n, part in (("train", tr), ("val", va))}
    ys = {n: torch.tensor([buckets.index(r.output_tokens) for r in part]) for n, part in (("train", tr), ("val", va))}
    torch.manual_seed(cfg.seed)
    head = LengthHead(enc.dim, cfg.hidden, buckets.num)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    best, best_state, best_epoch = float("inf"), None, 0
    for epoch in range(cfg.epochs):
        head.train()
        opt.zero_grad()
        loss = F.cross_entropy(head(xs["train"]), ys["train"])
        loss.backward()
        opt.step()
        head.eval()
        with torch.no_grad():
            val = F.cross_entropy(head(xs["val"]), ys["val"]).item()
        if val < best - 1e-4:
            best, best_epoch = val, epoch
            best_state = {k: v.clone() for k, v in head.state_dict().items()}
        elif epoch - best_epoch >= cfg.patience:
            break
    head.load_state_dict(best_state)
    with torch.no_grad():
        val_pred = head(xs["val"]).argmax(-1)
    val_acc = (val_pred == ys["val"]).float().mean().item()
    calibrated = []
    for k in range(buckets.num):
        got = [r.output_tokens for r, p in zip(va, val_pred.tolist()) if p == k]
        calibrated.append(sum(got) / len(got) if len(got) >= cfg.min_calibration else buckets.means[k])
    log(f"trained on {len(tr)} records ({buckets.num} buckets, cuts {[round(c) for c in buckets.cuts]}); "
        f"best validation loss {best:.3f} at epoch {best_epoch}, accuracy {val_acc:.3f}")
    mean = sum(r.output_tokens for r in tr) / len(tr)
    meta = PredictorMeta(encoder_dtype=getattr(enc, "dtype_name", "float32"), max_length=cfg.max_length,
                         hidden=cfg.hidden, model=records[0].model,
                         history=history_name, split_seed=cfg.seed, num_records=len(records),
                         train_size=len(tr), mean_length=mean, estimate=cfg.estimate, calibrated=calibrated,
                         stats={"val_loss": best, "val_accuracy": val_acc, "epochs": best_epoch + 1})
    return LearnedPredictor(head, buckets, meta, encoder=enc)


def accumulated_error(pred: list[float], true: list[int], sizes=GROUP_SIZES, trials: int = 1000,
                      seed: int = 0) -> dict[int, float]:
    """Mean over `trials` random groups (drawn with replacement) of |sum(pred) - sum(true)| / sum(true)."""
    rng = random.Random(seed)
    n = len(true)
    out = {}
    for g in sizes:
        errs = []
        for _ in range(trials):
            idx = [rng.randrange(n) for _ in range(g)]
            t = sum(true[i] for i in idx)
            errs.append(abs(sum(pred[i] for i in idx) - t) / max(t, 1))
        out[g] = sum(errs) / len(errs)
    return out


def evaluate(pred: LearnedPredictor, records: list[HistoryRecord], trials: int = 1000) -> dict:
    """On the held-out 20% of `records` (the split the predictor was trained with)."""
    if pred.meta.num_records and pred.meta.num_records != len(records):
        raise ValueError(f"the predictor was trained on a history of {pred.meta.num_records} records, this one "
                         f"has {len(records)}: evaluate on the same history file (the split is re-derived)")
    _, _, test = split(records, pred.meta.split_seed)
    true = [r.output_tokens for r in test]
    probs = pred.bucket_probs([r.prompt for r in test])
    bucket = probs.argmax(-1).tolist()
    learned = [pred.buckets.means[i] for i in bucket]
    calibrated = [pred.bucket_values("calibrated")[i] for i in bucket]
    constant = [pred.meta.mean_length] * len(test)
    truth_bucket = [pred.buckets.index(t) for t in true]
    acc = sum(a == b for a, b in zip(bucket, truth_bucket)) / len(test)
    majority = max(range(pred.buckets.num), key=lambda i: pred.buckets.counts[i])
    return {
        "test_size": len(test),
        "bucket_accuracy": acc,
        "majority_bucket_accuracy": sum(b == majority for b in truth_bucket) / len(test),
        "buckets": pred.buckets.labels(),
        "bucket_cuts": pred.buckets.cuts,
        "bucket_means": pred.buckets.means,
        "mean_true": sum(true) / len(true),
        "estimate": pred.meta.estimate,
        "calibrated_values": pred.bucket_values("calibrated"),
        "mean_predicted": {"bucket-mean": sum(learned) / len(test), "calibrated": sum(calibrated) / len(test),
                           "constant": pred.meta.mean_length},
        "accumulated_error": {"learned (bucket mean)": accumulated_error(learned, true, trials=trials),
                              "learned (calibrated)": accumulated_error(calibrated, true, trials=trials),
                              "constant (training mean)": accumulated_error(constant, true, trials=trials)},
    }


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, errs in result["accumulated_error"].items():
        by_size = {int(k): v for k, v in errs.items()}  # keys are strings once read back from JSON
        xs = sorted(by_size)
        ax.plot(xs, [100 * by_size[k] for k in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests per group")
    ax.set_ylabel("accumulated error of total length (%)")
    ax.set_title(f"Output-length prediction, held-out split (n={result['test_size']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
