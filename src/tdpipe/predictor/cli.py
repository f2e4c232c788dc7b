"""`tdpipe predictor train|eval`: the length predictor from a recorded history (TD-Pipe §3.3, §4.4.1)."""
from __future__ import annotations

import argparse
import json


def _percentiles(v: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in v.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--percentiles {v!r}: expected e.g. 25,50,75,99") from None


def _records(a: argparse.Namespace):
    from tdpipe.predictor.history import load_history, load_sharegpt

    if a.sharegpt:
        from tdpipe.model.bundled import resolve_model
        from tdpipe.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model(a.model))
        return load_sharegpt(a.history, lambda t: len(tok.encode(t, add_special_tokens=False)))
    return load_history(a.history)


def cmd_train(a: argparse.Namespace) -> int:
    import os

    from tdpipe.predictor.train import TrainConfig, train

    records = _records(a)
    cfg = TrainConfig(percentiles=a.percentiles, hidden=a.hidden, epochs=a.epochs, seed=a.seed,
                      max_length=a.max_length, estimate=a.estimate,
                      encoder_dtype=None if a.encoder_dtype == "auto" else a.encoder_dtype)
    pred = train(records, cfg, history_name=os.path.basename(a.history))
    pred.save(a.output)
    print(f"saved {a.output}")
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from tdpipe.predictor.model import LearnedPredictor
    from tdpipe.predictor.train import evaluate, plot

    pred = LearnedPredictor.load(a.predictor)
    r = evaluate(pred, _records(a), trials=a.trials)
    print(f"held-out split: {r['test_size']} requests, mean output {r['mean_true']:.1f} tokens")
    print(f"bucket accuracy {r['bucket_accuracy']:.3f} (always the most common bucket: "
          f"{r['majority_bucket_accuracy']:.3f}); buckets {r['buckets']} cut at "
          f"{[round(c) for c in r['bucket_cuts']]}, means {[round(m) for m in r['bucket_means']]}")
    mp = r["mean_predicted"]
    print(f"mean predicted length: bucket mean {mp['bucket-mean']:.1f}, calibrated {mp['calibrated']:.1f}, "
          f"constant {mp['constant']:.1f} (the predictor uses: {r['estimate']})")
    print("accumulated error of the total predicted length over random groups, |sum(pred) - sum(true)| / "
          "sum(true):")
    errs = r["accumulated_error"]
    names = list(errs)
    print(f"{'requests':>8} | " + " | ".join(f"{n:>24}" for n in names))
    for g in errs[names[0]]:
        print(f"{g:>8} | " + " | ".join(f"{100 * errs[n][g]:>23.1f}%" for n in names))
    if a.plot:
        plot(r, a.plot)
        print(f"plot -> {a.plot}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predictor", help="train / evaluate the output-length predictor (TD-Pipe §3.3)")
    ps = p.add_subparsers(dest="predictor_cmd", required=True)

    def source(q: argparse.ArgumentParser) -> None:
        q.add_argument("--history", required=True,
                       help="JSONL history written by --record-history (or ShareGPT JSON with --sharegpt)")
        q.add_argument("--sharegpt", action="store_true",
                       help="--history is ShareGPT JSON; output lengths counted with --model's tokenizer")
        q.add_argument("--model", default=None, help="tokenizer for --sharegpt (default: the bundled model)")

    t = ps.add_parser("train", help="fit the bucket classifier on 60%% of a history (20%% validation, "
                                    "20%% held out for eval)")
    source(t)
    t.add_argument("-o", "--output", required=True, help="predictor file to write (.pt)")
    t.add_argument("--percentiles", type=_percentiles, default=(25.0, 50.0, 75.0, 99.0),
                   help="bucket cuts as percentiles of the training lengths (default 25,50,75,99: "
                        "[P0,P25) [P25,P50) [P50,P75) [P75,P99) [P99,+))")
    t.add_argument("--hidden", type=int, default=256, help="hidden width of the two-layer head")
    t.add_argument("--epochs", type=int, default=400, help="most full-batch epochs (early stopping on validation)")
    t.add_argument("--max-length", type=int, default=256, help="encoder tokens per prompt (truncated)")
    t.add_argument("--encoder-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="precision of the MiniLM encoder, kept in the predictor file and used at serving time "
                        "(auto = bfloat16 where the CPU has bf16 instructions: ~4x faster here)")
    t.add_argument("--seed", type=int, default=0, help="split and initialisation seed")
    t.add_argument("--estimate", choices=["calibrated", "bucket-mean"], default="calibrated",
                   help="the length a predicted bucket stands for: bucket-mean = its mean training length "
                        "(μ-Serve); calibrated (default) = the mean true length of the validation requests "
                        "predicted into it, which keeps sums over many requests unbiased")
    t.set_defaults(fn=cmd_train)

    e = ps.add_parser("eval", help="bucket accuracy and accumulated error (Figure 14) on the held-out 20%%")
    source(e)
    e.add_argument("--predictor", required=True, help="file written by `tdpipe predictor train`")
    e.add_argument("--trials", type=int, default=1000, help="random groups per group size")
    e.add_argument("--plot", default=None, help="PNG of the accumulated error against group size")
    e.add_argument("--json", default=None, help="write the figures as JSON")
    e.set_defaults(fn=cmd_eval)
