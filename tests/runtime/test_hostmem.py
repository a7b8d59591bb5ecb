"""``turnip.runtime.hostmem``: the CUDA backend's host regions, allocated pinned or registered in place, with a
stand-in for libcuda (no GPU needed): what is called, with which pointer, when; bytes kept across pinning; a
region handed to the next backend released once, by its new owner."""

import ctypes

import numpy as np
import pytest

from turnip.runtime._cudadrv import SUCCESS, CudaError, Driver
from turnip.runtime.hostmem import PAGE, REGISTER_PORTABLE, PinnedRegion, host_register_on, register_spans
from turnip.runtime.layout import HostInputs

pytestmark = pytest.mark.unit


class FakeDriver:
    """Records the calls; pinned allocations are ctypes buffers kept alive here."""

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


def test_register_spans_cut_at_the_page_multiple_cuts_nearest_even_shares():
    n = 64 * PAGE
    cuts = [0, 3 * PAGE + 8, 15 * PAGE, 17 * PAGE, 33 * PAGE, 40 * PAGE, 50 * PAGE, n]
    assert register_spans(n, cuts, 1, least=PAGE) == [(0, n)]
    assert register_spans(n, cuts, 4, least=PAGE) == [(0, 15 * PAGE), (15 * PAGE, 33 * PAGE), (33 * PAGE, 50 * PAGE),
                                                       (50 * PAGE, n)]  # fmt: skip
    assert register_spans(n, [3 * PAGE + 8], 4, least=PAGE) == [(0, n)]  # no page-multiple cut: one piece
    assert register_spans(n, cuts, 4, least=n // 2) == [(0, 33 * PAGE), (33 * PAGE, n)]  # pieces of at least n/2
    starts = [0, 15 * PAGE, 17 * PAGE, 33 * PAGE, 40 * PAGE, 50 * PAGE]  # every page-multiple cut, no more
    assert register_spans(n, cuts, 64, least=PAGE) == list(zip(starts, [*starts[1:], n], strict=True))


def test_a_region_pinned_in_pieces_registers_and_releases_each(monkeypatch):
    monkeypatch.setenv("TURNIP_PIN_PIECES", "3")
    monkeypatch.setattr("turnip.runtime.hostmem.MIN_PIECE", PAGE)
    d = FakeDriver()
    r = PinnedRegion(d, 9 * PAGE + 10, register=True, ctx="ctx0")
    r.array[:] = 5
    r.pin(cuts=[3 * PAGE, 6 * PAGE, 7 * PAGE + 1])
    regs = sorted(c[1:] for c in d.calls if c[0] == "register")
    assert regs == [(r.ptr, 3 * PAGE, REGISTER_PORTABLE), (r.ptr + 3 * PAGE, 3 * PAGE, REGISTER_PORTABLE),
                    (r.ptr + 6 * PAGE, 3 * PAGE + 10, REGISTER_PORTABLE)]  # fmt: skip
    assert (r.array == 5).all() and d.calls.count(("context", "ctx0")) == 3  # each worker thread in the context
    p = r.ptr
    r.release()
    assert sorted(c[1] for c in d.calls if c[0] == "unregister") == [p, p + 3 * PAGE, p + 6 * PAGE]


def test_a_failed_piece_unregisters_the_others_and_names_where(monkeypatch):
    monkeypatch.setenv("TURNIP_PIN_PIECES", "2")
    monkeypatch.setattr("turnip.runtime.hostmem.MIN_PIECE", PAGE)
    d = FakeDriver()
    r = PinnedRegion(d, 4 * PAGE, register=True)
    d.cuMemHostRegister_v2 = lambda p, n, f: d.calls.append(("register", p, n, f)) or (999 if p != r.ptr else 0)
    with pytest.raises(CudaError, match=rf"cuMemHostRegister\({2 * PAGE} bytes at offset {2 * PAGE} of {4 * PAGE}\)"):
        r.pin(cuts=[2 * PAGE])
    assert [c for c in d.calls if c[0] == "unregister"] == [("unregister", r.ptr)] and not r.pinned


def test_the_switch(monkeypatch):
    monkeypatch.delenv("TURNIP_HOST_REGISTER", raising=False)
    assert not host_register_on()
    monkeypatch.setenv("TURNIP_HOST_REGISTER", "1")
    assert host_register_on()
