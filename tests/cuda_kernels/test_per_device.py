"""Device objects are looked up per device: a function handle, a loaded module or a cuDNN plan belongs to
the device whose context it was made in (a plan on two GPUs launches each kernel on its own GPU's handle).
No GPU needed: the current device and the libraries are stand-ins."""

from __future__ import annotations

import pytest

from cuda_kernels import cudnn_sdpa, fast, launch


class _Module:

    def __init__(self, dev):
        self.dev = dev

    def get_function(self, name):
        class _F:
            class kernel:  # noqa: N801 - CuPy's attribute names
                ptr = 0x1000 * (self.dev + 1) + len(name)

        return _F()


@pytest.mark.unit
def test_fast_kernel_handles_are_per_device(monkeypatch):
    dev = {"now": 0}
    monkeypatch.setattr(launch, "current_device", lambda: dev["now"])
    made = []

    class _Cupy:
        def RawModule(self, **kw):  # noqa: N802 - CuPy's name
            made.append(dev["now"])
            return _Module(dev["now"])

    monkeypatch.setattr(fast, "_cupy", lambda: _Cupy())
    compiled = _Module(0)  # as _ensure_module leaves it: compiled on device 0
    monkeypatch.setattr(fast, "_STATE", {"module": compiled, "error": None, "sms": 132, "modules": {0: compiled},
                                         "funcs": {}})  # fmt: skip
    name = fast.kernel_names()[0]
    h0 = fast._function(name)
    assert made == []  # device 0 uses the module compiled there
    dev["now"] = 1
    h1 = fast._function(name)
    assert made == [1] and h1 != h0
    assert fast._function(name) == h1 and made == [1]  # cached per device
    dev["now"] = 0
    assert fast._function(name) == h0


@pytest.mark.unit
def test_cudnn_graphs_are_built_per_device(monkeypatch):
    dev = {"now": 0}
    built = []

    class _Graph:
        def get_workspace_size(self):
            return 0

    def build(*key):
        built.append((dev["now"], key))
        return _Graph(), (None,) * 5

    monkeypatch.setattr(cudnn_sdpa, "_device", lambda: dev["now"])
    monkeypatch.setattr(cudnn_sdpa, "_build", build)
    monkeypatch.setattr(cudnn_sdpa, "_GRAPHS", {})
    args = (128, 128, 128, 8, 64, "fp16", 0.125, "none", False)
    cudnn_sdpa.CudnnSdpa(*args)
    cudnn_sdpa.CudnnSdpa(*args)
    assert [d for d, _ in built] == [0]
    dev["now"] = 1
    cudnn_sdpa.CudnnSdpa(*args)
    assert [d for d, _ in built] == [0, 1]
