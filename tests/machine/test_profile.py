from pathlib import Path

import pytest

import turnip.machine.profile
from turnip.machine.profile import MachineProfile, dump_toml, h100, load_profile

pytestmark = pytest.mark.unit


def test_h100_preset_matches_shipped_file():
    assert load_profile("h100") == h100()
    assert load_profile(Path(turnip.machine.profile.__file__).parent / "profiles" / "h100.toml") == h100()


def test_profile_files_round_trip(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text(dump_toml(h100().replace(n_gpus=4, h2d_bytes_per_s=25e9)))
    assert load_profile(p) == h100().replace(n_gpus=4, h2d_bytes_per_s=25e9)
    assert load_profile(p).host_h2d_total_bytes_per_s == (54.8e9, 104.0e9, 145.5e9, 159.2e9)  # the preset's host
    assert MachineProfile().host_both_total_bytes_per_s == ()  # a file without them: every link on its own
    j = tmp_path / "m.json"
    j.write_text('{"streams_per_gpu": 3}')
    assert load_profile(j).streams_per_gpu == 3


def test_unknown_profile_and_fields(tmp_path):
    with pytest.raises(FileNotFoundError, match="h100"):
        load_profile("a100-nonexistent")
    p = tmp_path / "bad.toml"
    p.write_text("warp_speed = 9\n")
    with pytest.raises(ValueError, match="warp_speed"):
        load_profile(p)


def test_kernel_calibration_sets_per_op_efficiency(tmp_path):
    from turnip.machine.costs import kernel_efficiency
    from turnip.sched.testing import make_memgraph

    cal = tmp_path / "cal.csv"
    cal.write_text("op,match,dtype,efficiency\neinsum,*,fp16,0.5\neinsum,hqk,khd->qhd,fp16,0.25\n".replace(
        "hqk,khd->qhd", '"hqk,khd->qhd"'))
    mg = make_memgraph(["kernel", "kernel", "kernel"], [[], [], []], flops=[1e9, 1e9, 1e9])
    mg.op[:] = ["einsum", "einsum", "rowmax"]
    mg.params[:] = [{"subscripts": "td,df->tf"}, {"subscripts": "hqk,khd->qhd"}, {}]
    mg.dtype[:] = ["fp16"] * 3
    prof = load_profile("h100").replace(kernel_calibration=str(cal))
    assert kernel_efficiency(mg, prof).tolist() == [0.5, 0.25, prof.kernel_efficiency]
    assert load_profile("h100-measured").kernel_calibration == "h100-kernels.csv"


def test_host_totals_and_peaks_round_trip(tmp_path):
    """The host's totals (tuples) and the peaks survive TOML and JSON; a list in a file loads as a tuple."""
    from turnip.machine.profile import dump_json

    p = h100().replace(host_h2d_total_bytes_per_s=(50e9, 90e9), host_d2h_total_bytes_per_s=(),
                       host_both_total_bytes_per_s=(60e9,), peak_hbm_bytes_per_s=4.8e12,
                       p2p_ports_serial=True)  # fmt: skip
    for name, text in (("r.toml", dump_toml(p)), ("r.json", dump_json(p))):
        f = tmp_path / name
        f.write_text(text)
        q = load_profile(f)
        assert q == p and isinstance(q.host_h2d_total_bytes_per_s, tuple) and hash(q) == hash(p)
    f = tmp_path / "t.toml"
    f.write_text("[machine]\nhost_d2h_total_bytes_per_s = [55e9, 100e9, 120e9]\n")
    assert load_profile(f).host_d2h_total_bytes_per_s == (55e9, 100e9, 120e9)
    assert load_profile("h200-calibrated").host_h2d_total_bytes_per_s == (54.7e9, 110.0e9, 161.6e9, 191.4e9)
    assert load_profile("h200-calibrated").peak_hbm_bytes_per_s == 4.8e12
    assert load_profile("h100-calibrated").host_both_total_bytes_per_s == (96.9e9, 145.9e9, 167.3e9, 170.7e9)
    assert load_profile("h100-calibrated").p2p_ports_serial and not h100().p2p_ports_serial


@pytest.mark.parametrize(
    "value", ["[1e9, -5.0]", "[1e9, 0]", "[inf]", "[nan]", "5e9", '"fast"', "[true]", '[1e9, "2e9"]']
)
def test_bad_host_totals_are_refused_in_one_line(tmp_path, value):
    f = tmp_path / "bad.toml"
    f.write_text(f"[machine]\nhost_h2d_total_bytes_per_s = {value}\n")
    with pytest.raises(ValueError, match="host_h2d_total_bytes_per_s") as e:
        load_profile(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)
    f.write_text("[machine]\npeak_fp16_flops_per_s = 0.0\n")
    with pytest.raises(ValueError, match="peak_fp16_flops_per_s"):
        load_profile(f)
    f.write_text("[machine]\np2p_ports_serial = 1\n")
    with pytest.raises(ValueError, match="p2p_ports_serial must be true or false"):
        load_profile(f)


def test_host_total_at_a_number_of_gpus():
    from turnip.machine.profile import host_total_bytes_per_s

    t = (54.8e9, 104.0e9, 145.5e9)
    assert [host_total_bytes_per_s(t, n) for n in range(1, 6)] == [None, 104.0e9, 145.5e9, 145.5e9, 145.5e9]
    assert host_total_bytes_per_s((), 4) is None


def test_auto_takes_the_shipped_profile_of_the_gpu_run_on(monkeypatch):
    """``--profile auto``: an H200's or an H100's calibrated profile by the GPU's name, the h100 preset for any other
    GPU, the fallback for the CPU backend or where no GPU answers; a named profile stays itself."""
    import cuda_kernels._numba as nb
    from turnip.machine.profile import profile_for_gpu
    from turnip.runtime.driver import machine_profile

    assert profile_for_gpu("NVIDIA H200") == "h200-calibrated"
    assert profile_for_gpu("NVIDIA H100 80GB HBM3") == "h100-calibrated"
    assert profile_for_gpu("NVIDIA A100-SXM4-40GB") == "h100"
    assert machine_profile("h100", "cuda") == "h100" and machine_profile("auto", "cpu") == "h100"
    assert machine_profile("auto", "cpu", fallback="h100-calibrated") == "h100-calibrated"

    class Dev:
        name = b"NVIDIA H200"

    monkeypatch.setattr(nb, "cuda", lambda: type("C", (), {"get_current_device": staticmethod(lambda: Dev)}))
    assert machine_profile("auto", "cuda") == "h200-calibrated"

    def none():
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(nb, "cuda", none)
    assert machine_profile("auto", "cuda", fallback="h100-calibrated") == "h100-calibrated"
