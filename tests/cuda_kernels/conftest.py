"""Tier gates: ``cudasim`` tests need NUMBA_ENABLE_CUDASIM=1 set before numba is imported (their own
invocation: ``scripts/test_cudasim.sh``); ``gpu`` tests need a real CUDA device."""

import os

import numpy as np
import pytest


def _simulating() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def pytest_runtest_setup(item):
    if item.get_closest_marker("cudasim") and not _simulating():
        pytest.skip("cudasim tier: run scripts/test_cudasim.sh (sets NUMBA_ENABLE_CUDASIM=1)")
    if item.get_closest_marker("gpu"):
        if _simulating():
            pytest.skip("gpu tier does not run under the CUDA simulator")
        from cuda_kernels._numba import available

        if not available():
            pytest.skip("no CUDA device")


@pytest.fixture
def rng(request):
    """Fresh inputs every run (seeded from the OS), with the seed in the failure report."""
    seed = int(np.random.SeedSequence().entropy % (2**32))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)

