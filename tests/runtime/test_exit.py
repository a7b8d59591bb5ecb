"""Processes that use several GPUs end cleanly: `turnip train` and `turnip run` on 2 (and 4) GPUs in a
subprocess exit 0 with nothing on stderr that a crash leaves (numba-cuda used to unload one kernel library
once per device at exit: "double free or corruption"). Skipped without enough GPUs; the unit test below the
GPU tests checks on any machine that numba's per-device function cache gets the first device's function."""

import os
import subprocess
import sys

import pytest

from tests.runtime.helpers import gpus

CRASH = ("double free", "corrupted", "free():", "malloc():", "Segmentation fault", "Aborted", "Traceback",
         "Fatal Python error")  # fmt: skip
CLI = "import sys; from turnip.cli import main; sys.exit(main(sys.argv[1:]))"


def _turnip(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONFAULTHANDLER": "1", "MALLOC_CHECK_": "3"}
    return subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True, env=env, timeout=600)


def _assert_clean(p: subprocess.CompletedProcess) -> None:
    bad = [b for b in CRASH if b in p.stderr]
    assert p.returncode == 0 and not bad, f"exit {p.returncode}, stderr: {p.stderr[-2000:]}"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_training_on_several_gpus_exits_cleanly(n):
    if gpus() < n:
        pytest.skip(f"needs {n} CUDA devices")
    _assert_clean(_turnip("train", "--model", "llama-tiny", "--seq", "64", "--batch", "4", "--steps", "2",
                          "--budget", "64MiB", "--gpus", str(n), "--backend", "cuda"))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_prefill_on_several_gpus_exits_cleanly(n):
    if gpus() < n:
        pytest.skip(f"needs {n} CUDA devices")
    _assert_clean(_turnip("run", "--model", "llama-tiny", "--seq", "256", "--budget", "64MiB", "--gpus", str(n),
                          "--backend", "cuda", "--repeat", "2"))  # fmt: skip


@pytest.mark.unit
def test_a_kernel_function_is_loaded_once_for_every_device(monkeypatch):
    """``function_handle``: the first device's loaded function serves the next device (no second load)."""
    from types import SimpleNamespace

    import cuda_kernels._numba as nb
    import cuda_kernels.launch as launch

    loads = []
    lib = SimpleNamespace(_cufunc_cache={}, get_cufunc=lambda: loads.append(1) or SimpleNamespace(handle=1234))
    kernel = SimpleNamespace(_codelibrary=lib)

    class _Gpus:
        def __getitem__(self, i):
            import contextlib

            return contextlib.nullcontext()

    monkeypatch.setattr(nb, "cuda", lambda: SimpleNamespace(gpus=_Gpus()))
    for dev in (0, 1, 2):
        monkeypatch.setattr(launch, "current_device", lambda dev=dev: dev)
        assert nb.function_handle(kernel) == 1234
    assert len(loads) == 1 and sorted(lib._cufunc_cache) == [0, 1, 2]
    assert len({id(f) for f in lib._cufunc_cache.values()}) == 1
