#!/usr/bin/env bash
# Kernel tests under the CUDA simulator, in their own pytest invocation: NUMBA_ENABLE_CUDASIM must be set
# before numba is imported. Exit code 5 (no tests collected) counts as success.
set -uo pipefail
cd "$(dirname "$0")/.."
NUMBA_ENABLE_CUDASIM=1 python -m pytest -m cudasim tests/cuda_kernels -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    exit 0
fi
exit "$rc"
