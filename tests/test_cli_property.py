"""Property: whatever the arguments, every subcommand ends with exit status 0, 1 or 2, never a traceback,
an `error:` line last on stderr when it fails, and no output file half-written (no temporary file left
behind, every file present complete). Argument lists mix valid and invalid values: numbers around 0 and
negatives, odd sizes, unknown flags, missing files, missing output directories; tiny models only, small
sequences, the cpu backend, few runs. About 630 argument lists in all (verify and report have fewer distinct
ones than their max_examples), about 30 s on 2 cores."""

import collections
import contextlib
import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnip.cli import main

pytestmark = pytest.mark.property

SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
RESULTS: collections.Counter = collections.Counter()  # (subcommand, exit status) -> argument lists



def mix(valid: list[str], invalid: list[str], weight: int = 3) -> list[str]:
    """Candidate values, the valid ones ``weight`` times as likely (most argument lists then run through)."""
    return valid * weight + invalid


SIZES = mix(["64KiB", "1MiB", "4096", "16GiB", "1.5MB"], ["0B", "1KiB", "1e3GiB", "garbage", "-1", "", "1e999", "32KB"])
INTS = mix(["0", "1", "2", "3"], ["-1", "9", "x", "1.5", ""])
GPUS = mix(["1", "2", "3"], ["0", "-1", "9", "x"])
SEQS = mix(["1", "8", "16", "32"], ["0", "-4", "abc", "64"])
TILES = mix(["t=8", "t=16", "h=2", "h=1", "f=40", "kv=16"], ["t=0", "t=-1", "kv=7", "q=5", "t", "t=abc", "d=64"], 2)
MODELS = mix(["llama-tiny", "llama-tiny", "paper-matmul", "random"], ["gpt-5"])
PROFILES = mix(["h100", "h100-measured", "{A}/good.json"], ["nosuch", "{A}/warp.toml", "{A}/broken.toml", "{A}"])
PLANS = mix(["{A}/plan.tplan"], ["{A}/corrupt.tplan", "{A}/missing.tplan", "{A}", "{A}/notg.tplan"])
OUT_FILES = mix(["{O}/out.{ext}"], ["{O}/missing/out.{ext}", "{O}", "{A}/afile/out.{ext}"], 5)


def call(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: usage errors (2), --help (0)
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    a = tmp_path_factory.mktemp("cli_assets")
    from turnip.memgraph.build import build_memgraph
    from turnip.memgraph.io import save_plan
    from turnip.models import llama_prefill
    from turnip.runtime.weights import random_inputs_for, write_safetensors

    rc, _, err = call(["compile", "--model", "llama-tiny", "--seq", "32", "--budget", "64KiB", "-o",
                       str(a / "plan.tplan")])  # fmt: skip
    assert rc == 0, err
    tg = llama_prefill("tiny", 16, 1, "fp32")
    save_plan(a / "notg.tplan", build_memgraph(tg, 1 << 20))  # no taskgraph: `run` refuses it
    data = (a / "plan.tplan").read_bytes()
    (a / "corrupt.tplan").write_bytes(data[:-100])
    (a / "warp.toml").write_text("warp_speed = 9\n")
    (a / "broken.toml").write_text("= = =\n")
    (a / "good.json").write_text('{"streams_per_gpu": 3}')
    (a / "cfg_ok.toml").write_text('[ablate]\nmodels = ["llama-tiny"]\nseqs = [16]\ngpus = [1]\nseeds = 1\n'
                                   'budgets = {small = "64KiB"}\n')  # fmt: skip
    (a / "cfg_unknown.toml").write_text("[ablate]\nseqz = [64]\n")
    (a / "cfg_bad.toml").write_text("[ablate]\nseqs = [0]\n")
    w = random_inputs_for(llama_prefill("tiny", 16), 3)
    write_safetensors(a / "w.safetensors", {k: v for k, v in w.items() if k != "ids"})
    (a / "garbage.safetensors").write_text("garbage")
    (a / "afile").write_text("x")
    (a / "emptyrep").mkdir()
    (a / "emptyrep" / "runs.csv").write_text("")
    rc, _, err = call(["ablate", "--models", "llama-tiny", "--seqs", "16", "--gpus", "1", "--budgets", "s=64KiB",
                       "--seeds", "2", "--jobs", "1", "--out", str(a / "rep")])  # fmt: skip
    assert rc == 0, err
    (a / "outs").mkdir()
    yield a
    total = sum(RESULTS.values())
    print(f"\n{total} argument lists: " + ", ".join(f"{c} exit {rc}: {n}" for (c, rc), n in sorted(RESULTS.items())))


def _complete(p: Path) -> None:
    """A file under an output directory is whole: readable as what its name says."""
    if p.suffix == ".tplan":
        from turnip.memgraph.io import load_plan

        load_plan(p)
    elif p.suffix == ".json":
        json.loads(p.read_text())
    elif p.suffix == ".csv":
        text = p.read_text()
        assert text == "" or text.endswith("\n"), p
        if text.strip():  # an empty table is written as a bare newline
            import pandas as pd

            pd.read_csv(p)
    elif p.suffix == ".png":
        b = p.read_bytes()
        assert b.startswith(b"\x89PNG") and b.rstrip().endswith(b"IEND\xaeB`\x82"), p


def check(assets: Path, argv_t: list[str], pre=None) -> None:
    out = Path(tempfile.mkdtemp(dir=assets / "outs"))
    try:
        if pre:
            pre(out)
        argv = [x.format(A=assets, O=out) for x in argv_t]
        rc, _, err = call(argv)
        RESULTS[argv[0], rc] += 1
        assert rc in (0, 1, 2), (argv, rc, err)
        assert "Traceback" not in err, (argv, err)
        if rc != 0:
            assert err.strip().splitlines()[-1].startswith("error:"), (argv, err)
        for d in (out, assets):
            assert not [p for p in d.rglob("*.tmp")], (argv, "temporary file left behind")
        for p in out.rglob("*"):
            if p.is_file():
                _complete(p)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@st.composite
def options(draw, table: dict, flags: tuple = (), max_size: int = 6):
    """Some of ``table``'s options (flag -> candidate values), each with a drawn value, plus maybe some of
    ``flags`` and an unknown flag (or --help), in a drawn order."""
    keys = draw(st.lists(st.sampled_from(sorted(table)), max_size=max_size, unique=True)) if table else []
    chunks = [[k, draw(st.sampled_from(table[k]))] for k in keys]
    chunks += [[f] for f in flags if draw(st.booleans())]
    if draw(st.integers(0, 15)) == 0:
        chunks.append([draw(st.sampled_from(["--bogus", "-z", "--help"]))])
    return [x for c in draw(st.permutations(chunks)) for x in c]


COMPILE = {
    "--model": MODELS, "--seq": SEQS, "--gpus": GPUS, "--budget": SIZES, "--dtype": mix(["fp16", "fp32"], ["fp64"]),
    "--policy": mix(["furthest", "lru", "largest"], ["nope"]), "--lookahead": INTS, "--lookahead-bytes": SIZES,
    "--tile": TILES, "--resident": mix(["auto", "0", "1KiB", "1e3GiB"], ["garbage"]),
    "--workspace": mix(["auto", "0", "256"], ["garbage"]), "--layers": mix(["1", "2"], ["0", "3", "-1"]),
    "--seed": INTS,
    "-o": [f.replace("{ext}", "tplan") for f in OUT_FILES],
}  # fmt: skip


@settings(max_examples=180, **SETTINGS)
@given(argv=options(COMPILE, ("--verify", "--json", "--force"), max_size=5))
def test_compile(assets, argv):
    check(assets, ["compile", "--model", "llama-tiny", "--seq", "16", *argv])


@settings(max_examples=40, **SETTINGS)
@given(plan=st.sampled_from(PLANS), argv=options({}, ("--json",)))
def test_verify(assets, plan, argv):
    check(assets, ["verify", plan, *argv])


SPECS = mix(["llama-tiny:16:1:64KiB", "llama-tiny:32:2:1MiB", "paper-matmul:1:1:1MiB", "random:1:2:1MiB"],
           ["x:y", "llama-tiny:0:1:1MiB", "llama-tiny:16:9:1MiB", "llama-tiny:16:1:zz", "llama-tiny:16:1:1KiB",
            "gpt:1:1:1MiB"], 2)  # fmt: skip
SIMULATE = {
    "--policy": mix(["nondet", "det", "nondet-cp", "det-kernels", "det-replay"], ["bogus"]),
    "--runs": mix(["1", "2", "3"], ["0", "-1", "x"]), "--record-runs": mix(["1", "2"], ["0"]),
    "--seed": INTS, "--profile": PROFILES, "--trace": [f.replace("{ext}", "json") for f in OUT_FILES],
    "--csv": [f.replace("{ext}", "csv") for f in OUT_FILES],
}  # fmt: skip


@settings(max_examples=150, **SETTINGS)
@given(plan=st.sampled_from(PLANS + SPECS), argv=options(SIMULATE, ("--mean-only", "--force"), max_size=4))
def test_simulate(assets, plan, argv):
    check(assets, ["simulate", plan, *argv])


ABLATE = {
    "--gpus": GPUS, "--budgets": mix(["a=64KiB", "b=1MiB"], ["c=0B", "d=zz", "e", "f=1KiB"]),
    "--policies": mix(["det", "nondet", "det-replay"], ["bogus"]), "--seeds": mix(["1", "2"], ["0", "-1"]),
    "--resident": mix(["auto", "0", "16KiB"], ["garbage"]),
    "--jobs": mix(["1"], ["0", "x"]), "--profile": PROFILES,
    "--config": mix(["{A}/cfg_ok.toml"], ["{A}/cfg_unknown.toml", "{A}/cfg_bad.toml", "{A}/none.toml"], 2),
    "--out": mix(["{O}/rep", "{O}/new/deeper"], ["{A}/afile"]),
}  # fmt: skip


@settings(max_examples=60, **SETTINGS)
@given(model=st.sampled_from(MODELS), seq=st.sampled_from(mix(["16"], ["0", "x"])),
       argv=options(ABLATE, ("--no-mean-only", "--force"), max_size=3))  # fmt: skip
def test_ablate(assets, model, seq, argv):
    # always a tiny model and short sequences (the defaults are LLaMA-7B at 1K-16K tokens) and one seed
    base = ["ablate", "--models", model, "--seqs", seq, "--seeds", "1", "--jobs", "1", "--out", "{O}/rep"]
    check(assets, base + argv)


@settings(max_examples=40, **SETTINGS)
@given(which=st.sampled_from(["good", "good", "{A}/emptyrep", "{A}/missing", "{A}/afile", "{O}/rep"]),
       extra=st.sampled_from([[], [], ["--bogus"], ["x"]]))  # fmt: skip
def test_report(assets, which, extra):
    def pre(out):
        if which == "good":
            shutil.copytree(assets / "rep", out / "rep")

    check(assets, ["report", "{O}/rep" if which == "good" else which, *extra], pre)


RUN = {
    "--model": MODELS, "--seq": SEQS, "--gpus": GPUS, "--budget": SIZES,
    "--dtype": ["fp16", "fp32"], "--resident": mix(["0", "auto"], ["garbage"]), "--tile": TILES,
    "--policy": mix(["nondet", "det", "det-replay"], ["bogus"]), "--record-runs": mix(["1", "2"], ["0"]),
    "--streams": mix(["1", "3"], ["0", "-1"]),
    "--repeat": mix(["1", "2"], ["0"]), "--warmup": mix(["0", "1"], ["-1"]), "--seed": INTS,
    "--chaos": mix(["0", "0.5"], ["2", "-1"]), "--stall-s": mix(["10"], ["0", "-1"]), "--profile": PROFILES,
    "--weights": mix(["{A}/w.safetensors"], ["{A}/garbage.safetensors", "{A}/none.safetensors"]),
    "--trace": [f.replace("{ext}", "json") for f in OUT_FILES], "--csv": [f.replace("{ext}", "csv") for f in OUT_FILES],
}  # fmt: skip


@settings(max_examples=180, **SETTINGS)
@given(plan=st.sampled_from([None, None, None, *PLANS]), argv=options(RUN, ("--check", "--force"), max_size=4))
def test_run(assets, plan, argv):
    base = ["run", *([plan] if plan else []), "--backend", "cpu", "--model", "llama-tiny", "--seq", "16",
            "--repeat", "1", "--warmup", "0", "--budget", "1MiB"]  # fmt: skip
    check(assets, base + argv)
