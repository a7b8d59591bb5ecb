"""The compiled event scan (``turnip.runtime._poll``) over a fake ``cuEventQuery``: an event's status is
whatever the test says it is now."""

import ctypes

import pytest

pytest.importorskip("numba")

from turnip.runtime._poll import NOT_READY, InFlight, build_scan  # noqa: E402

STATUS: dict[int, int] = {}
QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)(lambda ev: STATUS[ev])


@pytest.fixture(scope="module")
def scan():
    return build_scan(QUERY)


def test_completed_in_issue_order_rest_kept(scan):
    events = [1000 + v for v in range(10)]
    fl = InFlight(8, events, scan)
    for v in (3, 1, 4, 9, 5):
        fl.add(v)
        STATUS[events[v]] = NOT_READY
    assert fl.scan() == ([], -1, 0)
    STATUS[events[4]] = STATUS[events[3]] = STATUS[events[5]] = 0
    assert fl.scan() == ([3, 4, 5], -1, 0)
    assert fl.tolist() == [1, 9]
    fl.add(7)
    STATUS[events[7]] = 0
    assert fl.scan() == ([7], -1, 0)
    assert fl.tolist() == [1, 9] and fl.n == 2
    STATUS[events[1]] = STATUS[events[9]] = 0
    assert fl.scan() == ([1, 9], -1, 0) and fl.n == 0


def test_error_names_the_vertex(scan):
    events = [2000 + v for v in range(6)]
    fl = InFlight(8, events, scan)
    for v in range(5):
        fl.add(v)
        STATUS[events[v]] = NOT_READY
    STATUS[events[0]] = 0
    STATUS[events[3]] = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    done, bad, code = fl.scan()
    assert (done, bad, code) == ([], 3, 700)


def test_capacity(scan):
    fl = InFlight(2, [0, 1, 2], scan)
    fl.add(0)
    fl.add(1)
    with pytest.raises(RuntimeError, match="more than 2"):
        fl.add(2)
