"""``turnip.runtime.hostmem``: the CUDA backend's host regions, allocated pinned or registered in place, with a
stand-in for libcuda (no GPU needed): what is called, with which pointer, when; bytes kept across pinning; a
region handed to the next backend released once, by its new owner."""

import ctypes

import numpy as np
import pytest

from turnip.runtime._cudadrv import SUCCESS, CudaError, Driver
from turnip.runtime.hostmem import PAGE, REGISTER_PORTABLE, PinnedRegion, host_register_on
from turnip.runtime.layout import HostInputs

pytestmark = pytest.mark.unit


class FakeDriver:
    """Records the calls; pinned allocations are ctypes buffers kept alive here."""

    check = Driver.check

    def __init__(self, register_answer=SUCCESS):
        self.calls, self.buffers = [], {}
        self.cuMemHostRegister_v2 = self._f("register", register_answer)
        self.cuMemHostUnregister = self._f("unregister", SUCCESS)

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


def test_a_registered_region_is_plain_memory_until_its_first_run_and_keeps_its_bytes():
    d = FakeDriver()
    r = PinnedRegion(d, 3 * PAGE + 100, write_combined=True, register=True)
    assert not r.pinned and r.ptr % PAGE == 0 and r.array.size == 3 * PAGE + 100 and d.calls == []
    r.array[:] = np.arange(r.array.size) % 251
    want = r.array.copy()
    r.pin()
    r.pin()  # once only
    assert d.calls == [("register", r.ptr, r.array.size, REGISTER_PORTABLE)]
    np.testing.assert_array_equal(r.array, want)
    p = r.ptr
    r.release()
    r.release()
    assert d.calls[1:] == [("unregister", p)] and r.array is None


def test_an_allocated_region_is_pinned_at_once_and_freed_as_allocated():
    d = FakeDriver()
    r = PinnedRegion(d, 4096, write_combined=True)
    assert r.pinned and d.calls == [("alloc", 4096, True)]
    r.array[:] = 7
    r.pin()
    p = r.ptr
    r.release()
    assert d.calls[1:] == [("free", p)] and not d.buffers


def test_a_failed_registration_names_its_size():
    r = PinnedRegion(FakeDriver(register_answer=999), 2 * PAGE, register=True)
    with pytest.raises(CudaError, match=rf"cuMemHostRegister\({2 * PAGE} bytes\): error 999"):
        r.pin()


@pytest.mark.parametrize("register", [False, True])
def test_a_handed_over_region_is_released_once_by_the_backend_that_adopts_it(register):
    """``hand_over`` pins first; the old region releases nothing; ``HostInputs.take`` gives the release to the
    adopter, whose region releases it as it was made."""
    d = FakeDriver()
    r = PinnedRegion(d, 2 * PAGE, register=register)
    r.array[:5] = [1, 2, 3, 4, 5]
    array, ptr, release = r.hand_over()
    n = len(d.calls)
    r.release()
    assert len(d.calls) == n and r.array is None  # nothing left to release
    h = HostInputs(array, ("w",), ptr, release)
    new = PinnedRegion.adopted(d, h.array, h.ptr, h.take())
    h.free()  # the holder releases nothing once taken
    assert len(d.calls) == n and list(new.array[:5]) == [1, 2, 3, 4, 5] and new.pinned
    new.release()
    assert d.calls[-1] == (("unregister", ptr) if register else ("free", ptr))
    assert [c[0] for c in d.calls].count("unregister" if register else "free") == 1


def test_the_switch(monkeypatch):
    monkeypatch.delenv("TURNIP_HOST_REGISTER", raising=False)
    assert host_register_on()
    monkeypatch.setenv("TURNIP_HOST_REGISTER", "0")
    assert not host_register_on()
    monkeypatch.setenv("TURNIP_HOST_REGISTER", "1")
    assert host_register_on()
