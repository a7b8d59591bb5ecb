#!/usr/bin/env bash
# The GPU tier and the kernel / launch measurements in one go, on a machine with a CUDA device:
#   bash benchmarks/gpu_checks.sh OUT_DIR
# OUT_DIR/gpu_tests.log: pytest -m gpu over kernels and runtime; OUT_DIR/kernels_fast.csv:
# benchmarks/kernel_speed.py at 4096-token tiles with the CUDA C++ memory-bound kernels (and PyTorch's
# versions of each op, timed on the same buffers).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}
mkdir -p "$out"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/cuda_kernels tests/runtime tests/test_generation.py > "$out/gpu_tests.log" 2>&1
tail -15 "$out/gpu_tests.log"
timeout 120 python3 benchmarks/kernel_speed.py --tokens 4096 --reps 20 --fast --out "$out/kernels_fast.csv" \
    > "$out/kernels_fast.log" 2>&1
tail -n 25 "$out/kernels_fast.log"
