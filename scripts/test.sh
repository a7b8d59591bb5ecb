#!/usr/bin/env bash
# The whole test suite without a GPU: every CPU tier, then the CUDA-simulator kernel tier in its own
# interpreter (NUMBA_ENABLE_CUDASIM must be set before numba is imported). GPU tests skip cleanly.
set -uo pipefail
cd "$(dirname "$0")/.."
run() {  # pytest exit code 5 means "no tests collected": fine for a tier that may be empty
    "$@"
    rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
}
run python -m pytest -q "$@"
if [ -f scripts/test_cudasim.sh ]; then run bash scripts/test_cudasim.sh; fi
