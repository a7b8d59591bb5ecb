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
    assert load_profile(p) == MachineProfile(n_gpus=4, h2d_bytes_per_s=25e9)
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
