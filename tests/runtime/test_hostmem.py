"""``turnip.runtime.hostmem``: the CUDA backend's host regions, allocated pinned or registered in place, with a
stand-in for libcuda (no GPU needed): what is called, with which pointer, when; bytes kept across pinning; a
region handed to the next backend released once, by its new owner."""

import threading

import numpy as np
import pytest

from tests.runtime.helpers import FakeDriver
from turnip.runtime._cudadrv import CudaError
from turnip.runtime.hostmem import (
    PAGE,
    REGISTER_PORTABLE,
    PiecePinner,
    PinnedRegion,
    host_register_on,
    pin_while_filling_on,
    register_spans,
)
from turnip.runtime.layout import HostInputs

pytestmark = pytest.mark.unit


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
    array, ptr, release, pieces = r.hand_over()
    assert pieces == ([(0, 2 * PAGE)] if register else None)
    n = len(d.calls)
    r.release()
    assert len(d.calls) == n and r.array is None  # nothing left to release
    h = HostInputs(array, ("w",), ptr, release, pieces)
    new = PinnedRegion.adopted(d, h.array, h.ptr, h.take(), h.pieces)
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


def test_register_spans_cut_at_the_page_multiple_cuts_nearest_even_shares():
    n = 64 * PAGE
    cuts = [0, 3 * PAGE + 8, 15 * PAGE, 17 * PAGE, 33 * PAGE, 40 * PAGE, 50 * PAGE, n]
    assert register_spans(n, cuts, 1) == [(0, n)]
    assert register_spans(n, cuts, 4) == [(0, 15 * PAGE), (15 * PAGE, 33 * PAGE), (33 * PAGE, 50 * PAGE),
                                          (50 * PAGE, n)]  # fmt: skip
    assert register_spans(n, [3 * PAGE + 8], 4) == [(0, n)]  # no page-multiple cut: one piece
    starts = [0, 15 * PAGE, 17 * PAGE, 33 * PAGE, 40 * PAGE, 50 * PAGE]  # every page-multiple cut, no more
    assert register_spans(n, cuts, 64) == list(zip(starts, [*starts[1:], n], strict=True))


def test_a_piece_is_pinned_once_its_bytes_are_written_the_rest_at_the_end():
    """``PiecePinner``: a piece whose announced bytes are all written (or that was owed none) is registered while
    the others wait; ``finish`` registers the rest, leaves the region pinned and its release unregisters every
    piece."""
    d = FakeDriver()
    r = PinnedRegion(d, 8 * PAGE, register=True)
    spans = register_spans(r.nbytes, [2 * PAGE, 4 * PAGE, 6 * PAGE], 4)
    got = []
    cv = threading.Condition()
    real = d.cuMemHostRegister_v2

    def register(p, n, f):
        with cv:
            got.append(p - r.ptr)
            cv.notify_all()
        return real(p, n, f)

    def until(offsets):
        with cv:
            assert cv.wait_for(lambda: set(got) >= offsets, timeout=5)

    d.cuMemHostRegister_v2 = register
    pin = PiecePinner(r, spans, [(2 * PAGE, PAGE), (2 * PAGE + 100, PAGE - 100), (6 * PAGE, 2 * PAGE)], ctx="c0")
    until({0, 4 * PAGE})  # owed nothing
    pin.written(6 * PAGE, PAGE)  # half of the last piece
    pin.written(2 * PAGE, PAGE)
    with cv:
        assert not cv.wait_for(lambda: len(got) > 2, timeout=0.2)  # the second piece is still owed PAGE - 100
    pin.written(2 * PAGE + 100, PAGE - 100)
    until({0, 2 * PAGE, 4 * PAGE})
    assert 6 * PAGE not in got  # owed a page until the fill ends
    pin.finish()
    assert sorted(got) == [0, 2 * PAGE, 4 * PAGE, 6 * PAGE] and got[-1] == 6 * PAGE
    assert r.pinned and ("context", "c0") in d.calls
    r.pin()  # already pinned: nothing
    p = r.ptr
    r.release()
    assert sorted(c[1] - p for c in d.calls if c[0] == "unregister") == [0, 2 * PAGE, 4 * PAGE, 6 * PAGE]


def test_a_failed_piece_unregisters_the_others_and_names_where():
    d = FakeDriver()
    r = PinnedRegion(d, 4 * PAGE, register=True)
    real = d.cuMemHostRegister_v2
    d.cuMemHostRegister_v2 = lambda p, n, f: real(p, n, f) if p == r.ptr else 999
    pin = PiecePinner(r, register_spans(r.nbytes, [2 * PAGE], 2), [])
    with pytest.raises(CudaError, match=rf"cuMemHostRegister\({2 * PAGE} bytes at offset {2 * PAGE} of {4 * PAGE}\)"):
        pin.finish()
    assert [c for c in d.calls if c[0] == "unregister"] == [("unregister", r.ptr)] and not r.pinned
    abandoned = PinnedRegion(d, 4 * PAGE, register=True)
    d.cuMemHostRegister_v2 = real
    pin = PiecePinner(abandoned, register_spans(abandoned.nbytes, [2 * PAGE], 2), [(0, PAGE)])
    pin.abandon()  # the fill failed: whatever was registered goes again
    regs = [c[1] for c in d.calls if c[0] == "register" and c[1] >= abandoned.ptr]
    unregs = [c[1] for c in d.calls if c[0] == "unregister" and c[1] >= abandoned.ptr]
    assert sorted(regs) == sorted(unregs) and not abandoned.pinned


def test_an_error_in_the_pinning_thread_reaches_finish():
    d = FakeDriver()
    d.cuCtxSetCurrent = lambda ctx: 201  # CUDA_ERROR_INVALID_CONTEXT
    r = PinnedRegion(d, 4 * PAGE, register=True)
    pin = PiecePinner(r, register_spans(r.nbytes, [2 * PAGE], 2), [], ctx="gone")
    with pytest.raises(CudaError, match="cuCtxSetCurrent"):
        pin.finish()
    assert not r.pinned and not [c for c in d.calls if c[0] == "register"]


def test_the_pin_while_filling_switch(monkeypatch):
    monkeypatch.delenv("TURNIP_PIN_WHILE_FILLING", raising=False)
    assert pin_while_filling_on()
    monkeypatch.setenv("TURNIP_PIN_WHILE_FILLING", "0")
    assert not pin_while_filling_on()


def test_pieces_are_pinned_as_threads_finish_their_tiles_in_any_order():
    """Many tiles written by several threads in a random order: every piece is registered once, each after all
    of its announced bytes were written (none left owed when its registration began), and the region ends
    pinned with every piece released."""
    rng = np.random.default_rng(5)
    d = FakeDriver()
    r = PinnedRegion(d, 512 * PAGE, register=True)
    sizes = rng.integers(1, 8, size=120) * PAGE // 2
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    writes = [(int(o), int(n)) for o, n in zip(offs, sizes, strict=True) if o + n <= r.nbytes]
    spans = register_spans(r.nbytes, [o for o, _ in writes], 16)
    owed_at = []
    real = d.cuMemHostRegister_v2
    pin = None

    def register(p, n, f):
        k = pin._piece(p - r.ptr)
        owed_at.append((k, pin._left[k], pin._filled))
        return real(p, n, f)

    d.cuMemHostRegister_v2 = register
    pin = PiecePinner(r, spans, writes)
    order = rng.permutation(len(writes))
    chunks = np.array_split(order, 6)

    def write(chunk):
        for i in chunk:
            o, n = writes[i]
            r.array[o : o + n] = 1
            pin.written(o, n)

    ts = [threading.Thread(target=write, args=(c,)) for c in chunks]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    pin.finish()
    assert len(spans) > 4 and sorted(k for k, _, _ in owed_at) == list(range(len(spans)))
    assert all(left <= 0 for _, left, _ in owed_at)  # every announced byte of a piece written before it was pinned
    p = r.ptr
    r.release()
    assert sorted(c[1] - p for c in d.calls if c[0] == "unregister") == [i for i, _ in spans]


def test_a_handed_over_region_is_registered_again_where_the_new_plans_buffers_span_its_pieces():
    """A region pinned in pieces (cut where the plan before had buffers) and handed over keeps its pieces;
    ``mend`` joins the pieces a buffer of the adopting plan spans (a copy must lie inside one registration),
    leaves the others, and the release unregisters the pieces as they then are."""
    d = FakeDriver()
    r = PinnedRegion(d, 8 * PAGE, register=True)
    spans = register_spans(r.nbytes, [2 * PAGE, 4 * PAGE, 6 * PAGE], 4)
    pin = PiecePinner(r, spans, [])
    pin.finish()
    array, ptr, release, pieces = r.hand_over()
    assert pieces == [(0, 2 * PAGE), (2 * PAGE, 4 * PAGE), (4 * PAGE, 6 * PAGE), (6 * PAGE, 8 * PAGE)]
    a = PinnedRegion.adopted(d, array, ptr, release, pieces)
    assert a.mend([(0, 2 * PAGE), (6 * PAGE, PAGE)]) == 0  # each inside a piece
    d.calls.clear()
    assert a.mend([(3 * PAGE, 2 * PAGE), (5 * PAGE, 10)]) == 4 * PAGE  # spans pieces 1 and 2
    assert [(c[0], c[1] - ptr) for c in d.calls] == [("unregister", 2 * PAGE), ("unregister", 4 * PAGE),
                                                     ("register", 2 * PAGE)]  # fmt: skip
    assert d.calls[-1][2] == 4 * PAGE and a.pieces == [(0, 2 * PAGE), (2 * PAGE, 6 * PAGE), (6 * PAGE, 8 * PAGE)]
    assert a.mend([(PAGE, 7 * PAGE)]) == 8 * PAGE and a.pieces == [(0, 8 * PAGE)]  # every piece: one
    d.calls.clear()
    a.release()
    assert [(c[0], c[1] - ptr) for c in d.calls] == [("unregister", 0)]
    b = PinnedRegion(d, 4 * PAGE)  # allocated pinned: one allocation, nothing to mend
    assert b.pieces is None and b.mend([(0, 4 * PAGE)]) == 0
