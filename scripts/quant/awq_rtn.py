"""Write a model folder in AWQ's checkpoint format (AutoAWQ's GEMM packing, 4 bits, zero points), its decoder
linears quantised by round-to-nearest over groups of --group-size (model/awq.quantize_rtn): the folder the
AWQ figures in docs/quantization.md were measured on, since no published AWQ checkpoint can be downloaded
here. It is not AWQ's activation-aware scale search, so its perplexity is a floor for that method, not AWQ's.

    .venv/bin/python scripts/quant/awq_rtn.py --output /tmp/smollm2-awq --group-size 64
    .venv/bin/tdpipe bench perplexity --model /tmp/smollm2-awq --quantization none,awq
"""
from __future__ import annotations

import argparse

from tdpipe.model.awq import write_rtn_checkpoint
from tdpipe.model.bundled import resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or .gguf file (default: the bundled model)")
    p.add_argument("--output", required=True, help="folder to write")
    p.add_argument("--group-size", type=int, default=128,
                   help="columns per scale and zero point, a multiple of 32 dividing every linear's input "
                        "size (SmolLM2's 576: 64) (default: %(default)s)")
    a = p.parse_args()
    n = write_rtn_checkpoint(resolve_model(a.model), a.output, a.group_size)
    print(f"{a.output}: {n} linears as AWQ 4-bit groups of {a.group_size}")


if __name__ == "__main__":
    main()
