"""`tdpipe smoothquant --model M --output DIR`: write a SmoothQuant-smoothed copy of a checkpoint for W8A8.

The algorithm and why it helps are in model/smoothquant.py; docs/quantization.md has the perplexity it buys.
"""
from __future__ import annotations

import argparse
import json
import os

from tdpipe.entrypoints.preflight import PreflightError, check_model, check_readable
from tdpipe.model.smoothquant import ALPHA_GRID, AUTO, DEFAULT_ALPHA, DEFAULT_TOKENS, check_settings, parse_alpha


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "smoothquant", help="write a SmoothQuant-smoothed checkpoint for --quantization w8a8",
        description="SmoothQuant (Xiao et al., 2023, Eq. 4): run the model in float32 over calibration text, "
                    "then scale each decoder linear's input channels by 1/s and its weight columns by s, with "
                    "s_j = max|X_j|^alpha / max|W_j|^(1-alpha), folded into the norms and the v / up rows that "
                    "produce those inputs. The output folder computes the same function in float and loses "
                    "less to W8A8's per-token activation scales: run it with --quantization w8a8. Supported: "
                    "Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 3 (text) and Phi-3 checkpoints; a .gguf --model is "
                    "dequantised first.")
    p.add_argument("--model", default=None, help="model folder, .gguf file or random:NAME (default: the bundled model)")
    p.add_argument("--output", "-o", required=True, help="folder to write (must not exist, or be empty)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="text file to calibrate on (default: a built-in ~24 KB of tdpipe's docs: prose, "
                        "tables, commands and code)")
    p.add_argument("--alpha", type=_alpha, default=DEFAULT_ALPHA,
                   help=f"migration strength alpha of Eq. 4, in [0, 1], or {AUTO!r}: per layer and input, the "
                        f"alpha of {ALPHA_GRID[0]:g}, {ALPHA_GRID[1]:g}, ..., {ALPHA_GRID[-1]:g} whose int8 "
                        "outputs come closest to the float ones on the calibration rows (AWQ's grid search, "
                        "§3.2; the choices are written to OUTPUT/smoothquant.json) (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help="calibration tokens, read in windows of 512 (default: %(default)s)")
    p.set_defaults(fn=cmd_smoothquant)


def _alpha(text: str) -> float | str:
    try:
        return parse_alpha(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1] or {AUTO!r}, got {text!r}") from None


def cmd_smoothquant(a: argparse.Namespace) -> int:
    check_model(a.model)
    check_readable(a.calibration, "--calibration")
    if os.path.exists(a.output) and (not os.path.isdir(a.output) or os.listdir(a.output)):
        raise PreflightError(f"--output {a.output}: exists and is not an empty folder")
    check_settings(a.alpha, a.tokens)
    from tdpipe.model.bundled import resolve_model
    from tdpipe.model.smoothquant import smooth_checkpoint

    text = None
    if a.calibration:
        with open(a.calibration, encoding="utf-8") as f:
            text = f.read()
    report = smooth_checkpoint(resolve_model(a.model), a.output, text, a.alpha, a.tokens)
    print(json.dumps(report))
    return 0
