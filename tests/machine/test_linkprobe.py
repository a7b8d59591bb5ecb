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
