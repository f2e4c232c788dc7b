"""The learned output-length predictor (TD-Pipe §3.3 and §4.4.1, after μ-Serve): a frozen BERT-style sentence
encoder (all-MiniLM-L6-v2) and a two-layer feed-forward head that classifies a prompt into length buckets cut
at percentiles of the history ([P0,P25), [P25,P50), [P50,P75), [P75,P99), [P99,+) by default). The
prediction is the bucket's mean output length in training.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence as Seq

import torch
from torch import nn

from tdpipe.predictor.base import Predictor
from tdpipe.sequence import Sequence

DEFAULT_PERCENTILES = (25.0, 50.0, 75.0, 99.0)
FORMAT = "tdpipe-length-predictor/1"


def percentile(sorted_values: Seq[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of an empty list")
    k = (len(sorted_values) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


@dataclass
class Buckets:
    """Length buckets: bucket i holds lengths in [cuts[i-1], cuts[i]); `means` are the training means."""

    percentiles: list[float]
    cuts: list[float]
    means: list[float]
    counts: list[int]

    @classmethod
    def fit(cls, lengths: Seq[int], percentiles: Seq[float] = DEFAULT_PERCENTILES) -> "Buckets":
        ps = [float(p) for p in percentiles]
        if not ps or ps != sorted(ps) or len(set(ps)) != len(ps) or not 0 < ps[0] or ps[-1] >= 100:
            raise ValueError(f"bucket percentiles must be increasing, within (0, 100), got {list(percentiles)}")
        values = sorted(float(x) for x in lengths)
        cuts = [percentile(values, p) for p in ps]
        b = cls(ps, cuts, [0.0] * (len(cuts) + 1), [0] * (len(cuts) + 1))
        sums = [0.0] * len(b.means)
        for x in values:
            i = b.index(x)
            sums[i] += x
            b.counts[i] += 1
        overall = sum(values) / len(values)
        b.means = [s / c if c else overall for s, c in zip(sums, b.counts)]
        return b

    @property
    def num(self) -> int:
        return len(self.means)

    def index(self, length: float) -> int:
        return bisect.bisect_right(self.cuts, length)

    def value(self, i: int) -> float:
        return self.means[i]

    def labels(self) -> list[str]:
        names = ["P0"] + [f"P{p:g}" for p in self.percentiles] + ["+"]
        return [f"[{a},{b})" for a, b in zip(names, names[1:])]


class LengthHead(nn.Module):
    """Two-layer feed-forward classifier over the frozen sentence embedding."""

    def __init__(self, dim: int, hidden: int, num_buckets: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, num_buckets))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass
class PredictorMeta:
    encoder: str = "all-MiniLM-L6-v2"
    encoder_dtype: str = "float32"  # the head is trained on (and must be fed) this encoder precision
    max_length: int = 256
    hidden: int = 256
    model: str = ""  # the serving model whose history trained it
    history: str = ""
    split_seed: int = 0  # the 60/20/20 split (train.split): eval re-derives the held-out part from it
    num_records: int = 0
    train_size: int = 0
    mean_length: float = 0.0  # the constant baseline: the training mean
    # what a predicted bucket stands for: "bucket-mean" = the bucket's mean training length (μ-Serve, TD-Pipe
    # §3.3); "calibrated" = the mean true length of the validation requests the head put in that bucket, so
    # that sums over many requests (what Algorithm 1 adds up) are unbiased
    estimate: str = "bucket-mean"
    calibrated: list[float] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    ESTIMATES = ("bucket-mean", "calibrated")


class LearnedPredictor(Predictor):
    """`predict_batch` encodes many prompts at once (the engine calls it as requests arrive); `predict` is
    the one-request fallback. Predictions are capped by the request's max_tokens."""

    name = "learned"
    batched = True

    def __init__(self, head: LengthHead, buckets: Buckets, meta: PredictorMeta, encoder=None) -> None:
        self.head = head.eval()
        self.buckets = buckets
        self.meta = meta
        self._encoder = encoder
        self.text_of: Callable[[Sequence], str] = lambda s: s.prompt or ""
        self.seconds = 0.0  # time spent predicting (reported by the bench)
        self.count = 0

    @property
    def encoder(self):
        if self._encoder is None:
            from tdpipe.predictor.encoder import SentenceEncoder
            self._encoder = SentenceEncoder(max_length=self.meta.max_length, dtype=self.meta.encoder_dtype)
        return self._encoder

    @torch.no_grad()
    def bucket_probs(self, texts: list[str]) -> torch.Tensor:
        return torch.softmax(self.head(self.encoder.encode(texts)), dim=-1)

    def bucket_values(self, estimate: str | None = None) -> list[float]:
        estimate = estimate or self.meta.estimate
        if estimate not in PredictorMeta.ESTIMATES:
            raise ValueError(f"estimate must be one of {PredictorMeta.ESTIMATES}, got {estimate!r}")
        if estimate == "calibrated" and self.meta.calibrated:
            return self.meta.calibrated
        return self.buckets.means

    def predict_lengths(self, texts: list[str], estimate: str | None = None) -> list[int]:
        """Each text's most likely bucket, as a length (see PredictorMeta.estimate)."""
        if not texts:
            return []
        values = self.bucket_values(estimate)
        idx = self.bucket_probs(texts).argmax(-1).tolist()
        return [max(1, round(values[i])) for i in idx]

    def predict_batch(self, seqs: list[Sequence]) -> int:
        t = time.perf_counter()
        for s, n in zip(seqs, self.predict_lengths([self.text_of(s) for s in seqs])):
            s.predicted_output_len = max(1, min(n, s.max_tokens))
        self.seconds += time.perf_counter() - t
        self.count += len(seqs)
        return len(seqs)

    def predict(self, seq: Sequence) -> int:
        self.predict_batch([seq])
        return seq.predicted_output_len  # type: ignore[return-value]

    # -- file ------------------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        torch.save({"format": FORMAT, "meta": asdict(self.meta), "buckets": asdict(self.buckets),
                    "head": self.head.state_dict()}, path)

    @classmethod
    def load(cls, path: str) -> "LearnedPredictor":
        try:
            d = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - name the file whatever torch says
            raise ValueError(f"predictor file {path!r} could not be read: {e}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"predictor file {path!r} is not a tdpipe length predictor ({FORMAT})")
        meta = PredictorMeta(**d["meta"])
        buckets = Buckets(**d["buckets"])
        head = LengthHead(d["head"]["net.0.weight"].shape[1], meta.hidden, buckets.num)
        head.load_state_dict(d["head"])
        return cls(head, buckets, meta)
