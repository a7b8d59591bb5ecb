"""``turnip calibrate`` (and ``--refit``) with a bad input or output: one ``error:`` line, exit status 2, no
traceback, no output file, and no work started (no GPU preflight, no fit)."""

import json
from pathlib import Path

import pytest

from tests.clicall import call

pytestmark = pytest.mark.unit

PROFILES = Path(__file__).resolve().parents[1] / "turnip" / "machine" / "profiles"
CALIBRATED = PROFILES / "h100-calibrated.json"


@pytest.fixture
def no_work(monkeypatch):
    """Any long work (the GPU preflight, the refit's fit) fails the test: the checks must come first."""
    import sim.fit
    import turnip.cli.run_cmds

    def started(*a, **k):
        raise AssertionError("calibrate started its work before checking its arguments")

    monkeypatch.setattr(sim.fit, "fit_gpu_effects", started)
    monkeypatch.setattr(turnip.cli.run_cmds, "_cuda_preflight", started)


def one_usage_error(rc, err):
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and "internal error" not in err and "driver" not in err, err


def test_refit_toml_profile_is_refused(tmp_path, no_work):
    out = tmp_path / "r3.json"
    rc, _, err = call(["calibrate", "--refit", str(PROFILES / "h100.toml"), "-o", str(out)])
    one_usage_error(rc, err)
    assert "--refit needs a profile written by `turnip calibrate`" in err and "h100.toml" in err
    assert not out.exists()


def test_refit_malformed_json(tmp_path, no_work):
    bad, out = tmp_path / "bad.json", tmp_path / "r3.json"
    bad.write_text("{not json")
    rc, _, err = call(["calibrate", "--refit", str(bad), "-o", str(out)])
    one_usage_error(rc, err)
    assert f"{bad}: not a valid JSON profile" in err and not out.exists()


def test_refit_json_without_measurements(tmp_path, no_work):
    doc = json.loads(CALIBRATED.read_text())
    del doc["calibration"]
    src, out = tmp_path / "plain.json", tmp_path / "r3.json"
    src.write_text(json.dumps(doc))
    rc, _, err = call(["calibrate", "--refit", str(src), "-o", str(out)])
    one_usage_error(rc, err)
    assert "--refit needs a profile written by `turnip calibrate`" in err and not out.exists()


@pytest.mark.parametrize("what", ["nope.json", "adir", "h100-calibrated"])
def test_refit_missing_file(tmp_path, monkeypatch, no_work, what):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    rc, _, err = call(["calibrate", "--refit", what, "-o", "x.json"])
    one_usage_error(rc, err)
    assert f"--refit {what}: " in err and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("name", ["r.toml", "r", "r.JSON"])
@pytest.mark.parametrize("refit", [True, False])
def test_output_not_json_is_refused_first(tmp_path, no_work, name, refit):
    out = tmp_path / name
    argv = ["calibrate", "-o", str(out)] + (["--refit", str(CALIBRATED)] if refit else [])
    rc, _, err = call(argv)
    one_usage_error(rc, err)
    assert f"--output {out}" in err and ".json" in err and not out.exists()


def test_refit_good_profile_still_runs(tmp_path, monkeypatch):
    """The checks do not refuse what --refit can do (the fit itself stubbed: it takes ~20 s)."""
    import sim.fit
    from turnip.machine.profile import load_profile

    monkeypatch.setattr(sim.fit, "fit_gpu_effects", lambda doc, log=print: {"name": "refitted"})
    out = tmp_path / "r.json"
    rc, stdout, err = call(["calibrate", "--refit", str(CALIBRATED), "-o", str(out)])
    assert rc == 0 and err == "" and "refitted from" in stdout
    assert load_profile(out).name == "refitted"


def test_calibrate_hands_the_simulators_fit_to_the_measuring(tmp_path, monkeypatch):
    """The measuring (``turnip.calibrate``) never imports the simulator: the CLI passes it ``sim.fit``'s fit
    (the measurements themselves stubbed: they need a GPU)."""
    import sim.fit
    import turnip.calibrate
    import turnip.cli.run_cmds

    fields = ("h2d_bytes_per_s", "d2h_bytes_per_s", "pcie_both_bytes_per_s", "copy_latency_ns", "gemm_launch_ns",
              "attn_launch_ns", "kernel_launch_ns", "copy_launch_ns", "completion_ns")  # fmt: skip
    got = {}

    def measured(dtypes, quick, **kw):
        got.update(kw)
        doc = {"machine": dict.fromkeys(fields, 1.0), "kernels": [], "copies": [], "calibration": {"seconds": 1}}
        doc["machine"] |= kw["fit"](doc, log=print)
        return doc

    monkeypatch.setattr(turnip.cli.run_cmds, "_cuda_preflight", lambda *a, **k: None)
    monkeypatch.setattr(turnip.calibrate, "calibrate", measured)
    monkeypatch.setattr(sim.fit, "fit_gpu_effects", lambda doc, log=print: {"name": "fitted"})
    out = tmp_path / "p.json"
    rc, _stdout, err = call(["calibrate", "-o", str(out)])
    assert rc == 0 and err == "", err
    assert json.loads(out.read_text())["machine"]["name"] == "fitted"
