"""``Driver.enable_peer`` with a stand-in for libcuda: what the CUDA backend and the link probes call to let one
GPU reach another's memory (no GPU needed)."""

import pytest

from turnip.runtime._cudadrv import PEER_ACCESS_ALREADY_ENABLED, SUCCESS, CudaError, Driver

pytestmark = pytest.mark.unit


class FakeDriver:
    """Records the calls; ``peers``: the (device, device) pairs that can reach each other; ``answer``: what
    cuCtxEnablePeerAccess returns."""

    check, enable_peer = Driver.check, Driver.enable_peer

    def __init__(self, peers, answer=SUCCESS):
        self.peers, self.answer, self.calls = set(peers), answer, []

    def can_access_peer(self, dev, peer):
        return (dev, peer) in self.peers

    def cuCtxSetCurrent(self, ctx):
        self.calls.append(("current", ctx))
        return SUCCESS

    def cuCtxEnablePeerAccess(self, ctx, flags):
        self.calls.append(("enable", ctx))
        return self.answer

    def error_name(self, r):
        return f"error {r}"


def test_enables_where_the_devices_allow_it_in_the_context_of_the_one_that_reaches():
    d = FakeDriver({(7, 5)})
    d.enable_peer(["c0", "c1"], [7, 5], 0, 1)  # plan GPUs 0 and 1 on devices 7 and 5
    assert d.calls == [("current", "c0"), ("enable", "c1")]
    d.calls.clear()
    d.enable_peer(["c0", "c1"], [7, 5], 1, 0)  # device 5 cannot reach 7: nothing called
    assert d.calls == []


def test_already_enabled_is_fine_any_other_failure_names_the_pair():
    FakeDriver({(0, 1)}, PEER_ACCESS_ALREADY_ENABLED).enable_peer(["a", "b"], range(2), 0, 1)
    with pytest.raises(CudaError, match=r"cuCtxEnablePeerAccess\(gpu 0 -> gpu 1\): error 999"):
        FakeDriver({(0, 1)}, 999).enable_peer(["a", "b"], range(2), 0, 1)
