"""``turnip.linkprobe``'s profile fields from its measurements; the measurements themselves on GPUs."""

import pytest

from turnip.linkprobe import PORTS_SERIAL_BELOW, link_fields, ports_fields


def test_ports_are_serial_when_copies_at_once_move_no_more_than_one():
    """Four H100s: three copies out of GPU 0 at once moved about what one alone does (a 7B run's trace): one
    queue each way. Ports that carry several copies at once are not serial; no measurement, no field."""
    assert ports_fields({"one": 350e9, "out": 360e9, "into": 380e9}) == {"p2p_ports_serial": True}
    assert ports_fields({"one": 350e9, "out": 900e9, "into": 380e9}) == {"p2p_ports_serial": False}
    edge = PORTS_SERIAL_BELOW * 100e9
    assert ports_fields({"one": 100e9, "out": edge, "into": edge - 1}) == {"p2p_ports_serial": False}
    assert ports_fields({}) == {}


def test_link_fields_name_the_profile_totals():
    rates = {"h2d": [55e9, 106e9], "d2h": [55e9, 107e9], "both": [91e9, 136e9]}
    assert link_fields(rates) == {"host_h2d_total_bytes_per_s": [55e9, 106e9],
                                  "host_d2h_total_bytes_per_s": [55e9, 107e9],
                                  "host_both_total_bytes_per_s": [91e9, 136e9]}  # fmt: skip


@pytest.mark.gpu
def test_the_ports_probe_on_three_or_more_gpus():
    from tests.runtime.helpers import gpus
    from turnip.linkprobe import measure_p2p_ports

    if gpus() < 3:
        pytest.skip("needs three CUDA devices")
    rates = measure_p2p_ports(3, nbytes=16 << 20, passes=1)
    assert set(rates) == {"one", "out", "into"} and all(r > 1e9 for r in rates.values())
    assert isinstance(ports_fields(rates)["p2p_ports_serial"], bool)


@pytest.mark.gpu
def test_the_relay_probe_on_two_or_more_gpus():
    """Host->GPU copies into the last GPU: by its own link, issued by every GPU straight into it, staged through
    the others' memory; one GPU alone: nothing to measure."""
    from tests.runtime.helpers import gpus
    from turnip.linkprobe import measure_relay

    if gpus() < 2:
        pytest.skip("needs two CUDA devices")
    rates = measure_relay(2, nbytes=16 << 20, reps=2, passes=1)
    assert set(rates) == {"own", "relay", "staged"} and all(r > 1e9 for r in rates.values())
    assert measure_relay(1) == {}


class _FakeGpus:
    """``cuda().gpus`` of a stand-in: entering GPU d makes context ``c{d}`` current on the driver."""

    def __init__(self, drv, n):
        self.drv, self.n = drv, n

    def __len__(self):
        return self.n

    def __getitem__(self, d):
        drv = self.drv

        class Gpu:
            def __enter__(self):
                drv.cur = f"c{d}"

            def __exit__(self, *exc):
                return False

        return Gpu()


class _FakeDriver:
    """Records what a probe's set-up allocates and its teardown frees; ``fail_at``: the n-th device allocation
    fails (a set-up that stops half way)."""

    def __init__(self, fail_at=None):
        self.cur, self.n_alloc, self.fail_at, self.log = "caller", 0, fail_at, []

    def current_context(self):
        return self.cur

    def cuCtxSetCurrent(self, ctx):
        self.cur = ctx
        return 0

    def cuCtxSynchronize(self):
        self.log.append(("sync", self.cur))
        return 0

    def device_alloc(self, nbytes):
        self.n_alloc += 1
        if self.n_alloc == self.fail_at:
            raise RuntimeError("out of memory")
        self.log.append(("dev", self.cur, self.n_alloc))
        return self.n_alloc

    def host_alloc(self, nbytes, wc):
        self.log.append(("host", nbytes, wc))
        return 1000 + len(self.log)

    def cuMemFree_v2(self, p):
        self.log.append(("free dev", self.cur, p))

    def cuMemFreeHost(self, p):
        self.log.append(("free host", p))


@pytest.mark.parametrize("fail_at", [None, 3])
def test_a_probes_set_up_frees_what_it_made_and_restores_the_callers_context(monkeypatch, fail_at):
    """``_set_up``: per GPU its context, device buffers, streams and portable host buffers; after (also when an
    allocation fails half way) every GPU synchronised, its streams destroyed and device buffers freed in its own
    context, the host buffers freed, the caller's context current again."""
    import cuda_kernels._numba as nb
    import cuda_kernels.launch as launch
    import turnip.linkprobe as lp
    import turnip.runtime._cudadrv as cd

    drv = _FakeDriver(fail_at)
    streams, destroyed = iter(range(100, 200)), []

    class FakeLaunchDriver:
        def cuStreamDestroy_v2(self, s):
            destroyed.append(s)

    monkeypatch.setattr(nb, "cuda", lambda: type("C", (), {"gpus": _FakeGpus(drv, 2)})())
    monkeypatch.setattr(launch, "capture_stream", lambda: next(streams))
    monkeypatch.setattr(launch, "driver", FakeLaunchDriver)
    monkeypatch.setattr(cd, "Driver", lambda: drv)
    assert lp._visible(None) == 2 and lp._visible(5) == 2 and lp._visible(1) == 1
    got = None
    try:
        with lp._set_up(2, 64, lambda d: 1 + d, 2, 1) as got:
            assert drv.cur == "c1"
    except RuntimeError as e:
        assert fail_at is not None and "out of memory" in str(e)
    made = [x for x in drv.log if x[0] == "dev"]
    freed = [x for x in drv.log if x[0] == "free dev"]
    assert sorted(freed) == sorted(("free dev", c, p) for _, c, p in made)  # each in the context it was made in
    hosts = [x for x in drv.log if x[0] == "host"]
    assert len([x for x in drv.log if x[0] == "free host"]) == len(hosts) and all(not wc for *_, wc in hosts)
    assert drv.cur == "caller" and sorted(destroyed) == list(range(100, 100 + len(destroyed)))
    if fail_at is None:
        _, ctx, dev, st, host = got
        assert ctx == ["c0", "c1"] and [len(x) for x in dev] == [1, 2] and [len(x) for x in st] == [2, 2]
        assert [len(x) for x in host] == [1, 1] and len(destroyed) == 4
        assert [x for x in drv.log if x[0] == "sync"] == [("sync", "c0"), ("sync", "c1")]
    else:  # GPU 0 set up whole, GPU 1's second buffer failed: its first freed too, both GPUs waited for
        assert len(made) == 2 and len(destroyed) == 2
        assert [x for x in drv.log if x[0] == "sync"] == [("sync", "c0"), ("sync", "c1")]
