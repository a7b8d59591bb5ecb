"""Plans and reference values shared by the runtime tests."""

from __future__ import annotations

import ctypes

import numpy as np

from turnip.compile import build_with_resident
from turnip.memgraph.interp import evaluate_taskgraph, random_inputs
from turnip.models import llama_prefill, random_dag
from turnip.runtime._cudadrv import SUCCESS, Driver


def tiny_llama(budget: int = 64 * 1024, dtype: str = "fp32", n_gpus: int = 1, resident: str = "0"):
    tg = llama_prefill("tiny", seq=64, n_gpus=n_gpus, dtype=dtype)
    return tg, build_with_resident(tg, budget, None, resident)


def dag(seed: int, n_gpus: int = 1, p_sum_into: float = 0.15):
    """A random DAG plan under the tightest budget (of a few) it compiles in."""
    from turnip.memgraph.build import BudgetError

    tg = random_dag(np.random.default_rng(seed), n_kernels=60, n_gpus=n_gpus, p_sum_into=p_sum_into)
    for kib in (6, 8, 10, 12, 16, 24):
        try:
            return tg, build_with_resident(tg, kib * 1024)
        except BudgetError:
            continue
    raise AssertionError(f"random DAG {seed} does not compile under 24 KiB")


def reference(tg, seed: int = 0):
    inputs = random_inputs(tg, np.random.default_rng(seed))
    return inputs, evaluate_taskgraph(tg, inputs)


def rel_err(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def gpus() -> int:
    """CUDA devices visible to numba (0 under the CUDA simulator or without a driver)."""
    try:
        from cuda_kernels._numba import available, cuda, simulating

        return 0 if simulating() or not available() else len(cuda().gpus)
    except Exception:
        return 0


class FakeDriver:
    """A stand-in for libcuda's host memory calls (``turnip.runtime.hostmem``): records the calls; pinned
    allocations are ctypes buffers kept alive here."""

    check = Driver.check

    def __init__(self, register_answer=SUCCESS):
        self.calls, self.buffers = [], {}
        self.cuMemHostRegister_v2 = self._f("register", register_answer)
        self.cuMemHostUnregister = self._f("unregister", SUCCESS)
        self.cuCtxSetCurrent = self._f("context", SUCCESS)

    def _f(self, name, answer):
        def f(*args):
            self.calls.append((name, *args))
            return answer

        return f

    def host_alloc(self, nbytes, write_combined):
        buf = (ctypes.c_uint8 * nbytes)()
        p = ctypes.addressof(buf)
        self.buffers[p] = buf
        self.calls.append(("alloc", nbytes, write_combined))
        return p

    def cuMemFreeHost(self, p):
        self.calls.append(("free", p))
        del self.buffers[p]
        return SUCCESS

    def error_name(self, r):
        return f"error {r}"
