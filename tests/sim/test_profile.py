import pytest

from sim.profile import MachineProfile, dump_toml, h100, load_profile

pytestmark = pytest.mark.unit


def test_h100_preset_matches_shipped_file():
    assert load_profile("h100") == h100()
    assert load_profile("sim/profiles/h100.toml") == h100()


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
