"""The turnip command: compile, verify, and errors for bad input."""

import json

import pandas as pd
import pytest

from turnip.cli import main

pytestmark = pytest.mark.unit


def test_compile_verify_round_trip(tmp_path, capsys):
    plan = tmp_path / "p.tplan"
    rc = main(
        [
            "compile",
            "--model",
            "llama-tiny",
            "--seq",
            "32",
            "--gpus",
            "2",
            "--budget",
            "40KB",
            "--dtype",
            "fp32",
            "-o",
            str(plan),
            "--json",
            "--verify",
        ]
    )
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["violations"] == [] and d["memgraph_vertices"] >= d["taskgraph_vertices"]
    assert set(d) >= {
        "edges",
        "offloads",
        "reloads",
        "clean_evictions",
        "peak_nbytes_per_gpu",
        "host_peak_nbytes",
        "build_s",
    }
    assert main(["verify", str(plan)]) == 0
    assert "ok" in capsys.readouterr().out


def test_human_summary(capsys):
    assert main(["compile", "--model", "paper-matmul", "--budget", "1024"]) == 0
    out = capsys.readouterr().out
    assert "offload   1" in out and "memory" in out and "peak/GPU" in out


def test_bad_inputs(tmp_path, capsys):
    assert main(["compile", "--model", "llama-tiny", "--seq", "32", "--budget", "4KB"]) == 1
    assert "cannot get" in capsys.readouterr().err
    assert main(["compile", "--model", "llama-tiny", "--budget", "lots"]) == 2
    assert "byte size" in capsys.readouterr().err
    assert main(["compile", "--model", "llama-tiny", "--tile", "tokens=5"]) == 2
    bad = tmp_path / "bad.tplan"
    bad.write_text("nope")
    assert main(["verify", str(bad)]) == 2
    assert "not a turnip plan" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compile", "--model", "gpt-5"])


def test_simulate_a_lora_training_step(tmp_path, capsys):
    argv = ["simulate", "llama-tiny:16:1:96KiB", "--train", "lora", "--batch", "2", "--runs", "2"]
    assert main([*argv, "--csv", str(tmp_path / "runs.csv")]) == 0
    out = capsys.readouterr().out
    assert "one LoRA training step of 2 x 16 tokens" in out and "lower bound" in out
    assert "lora,2" in (tmp_path / "runs.csv").read_text().splitlines()[1]
    plan = tmp_path / "p.tplan"
    assert main(["compile", "--model", "llama-tiny", "--seq", "16", "--budget", "96KiB", "-o", str(plan)]) == 0
    assert main(["simulate", str(plan), "--train", "lora"]) == 2  # a compiled plan: compile it with --train
    assert "compiled plan" in capsys.readouterr().err


def test_simulate_reports_one_runs_bound_when_host_and_link_are_drawn(capsys):
    """With a profile whose host and host link factors are drawn per run, the bound printed and its parts are
    the first run's (each run has its own), and the efficiency is each run against its own bound."""
    import re

    assert main(["simulate", "llama-7b:1024:1:1GiB", "--runs", "3", "--profile", "h100-calibrated"]) == 0
    out = capsys.readouterr().out
    lb = float(re.search(r"lower bound ([0-9.]+) ms \(run 1's", out).group(1))
    parts = re.search(r"lower bound .*\(critical_path ([0-9.]+), kernel ([0-9.]+), link ([0-9.]+); host ([0-9.]+), "
                      r"not in the bound\)", out)  # fmt: skip
    assert max(float(x) for x in parts.groups()[:3]) == pytest.approx(lb, abs=0.05) and "_ns" not in parts.group(0)
    assert 0.5 < float(re.search(r"efficiency ([0-9.]+)", out).group(1)) <= 1.0
    assert main(["simulate", "llama-7b:1024:1:1GiB", "--runs", "2", "--profile", "h100-calibrated",
                 "--host-factor", "1", "--link-factor", "1"]) == 0  # fmt: skip
    assert "run 1's" not in capsys.readouterr().out  # given factors: every run has the same bound


@pytest.mark.parametrize(
    "plan, flag, f, said, lo, hi",
    [  # a tiny plan is host-bound: three times the host costs, much longer runs
        ("llama-tiny:64:1:1MiB", "--host-factor", "3", "host costs x 3", 1.5, None),
        # a streamed 7B plan at 1K is link-bound: copies 1.5 times slower, runs about 1.5 times longer
        ("llama-7b:1024:1:1GiB", "--link-factor", "1.5", "host link copies x 1.5", 1.35, 1.5),
    ],
)
def test_simulate_with_a_slower_host_or_link(tmp_path, capsys, plan, flag, f, said, lo, hi):
    argv = ["simulate", plan, "--runs", "1", "--mean-only", "--profile", "h100-calibrated"]
    col = flag[2:].replace("-", "_")
    ms = {}
    for x in (None, f):
        csv = tmp_path / f"runs{x}.csv"
        assert main([*argv, "--csv", str(csv)] + ([flag, x] if x else [])) == 0
        assert (said in capsys.readouterr().out) == (x is not None)
        run = pd.read_csv(csv).iloc[0]
        ms[x] = int(run.makespan_ns)
        assert run[col] == (float(x) if x else 1.0)  # the run's factor: given, or the median (mean-only)
    assert lo * ms[None] < ms[f] and (hi is None or ms[f] < hi * ms[None])


def test_check_of_a_training_step_allows_adam_sign_flips_and_nothing_more(capsys):
    """``run --train lora --check``: an Adam step moves each parameter by about lr x sign(gradient), so a
    near-zero gradient whose sign rounding flips lands 2 lr away; a few such elements pass (seed 4 has about
    five, by BLAS and the order the folded sums take), more than 1% of them, or any one further off, fail, as
    does any other output beyond the tolerance (named)."""
    import re
    from types import SimpleNamespace

    import numpy as np

    from turnip.cli.run_cmds import _check_outputs

    assert main(["run", "--budget", "4MiB", "--repeat", "1", "--seq", "64", "--train", "lora", "--check",
                 "--seed", "4"]) == 0  # fmt: skip
    m = re.search(r"Adam-updated parameters: (\d+) of (\d+) elements", capsys.readouterr().out)
    # how many signs flip depends on the platform's BLAS rounding (a few)
    assert m and 1 <= int(m.group(1)) <= int(m.group(2)) // 100
    lr = 1e-4
    tg = SimpleNamespace(op=["adam_p", "matmul"], name=["A.new", "loss"], params=[{"lr": lr}, {}])
    ref = {0: np.full(1000, 1e-3), 1: np.ones(8)}

    def check(adam, other):
        ok = _check_outputs(tg, {0: adam, 1: other}, ref, 2e-2)
        return ok, capsys.readouterr().out

    flipped = ref[0].copy()
    flipped[:5] -= 2 * lr  # five signs flipped: 0.5% of the elements
    assert check(flipped, ref[1])[0]
    many = ref[0].copy()
    many[:20] -= 2 * lr  # 2%
    assert not check(many, ref[1])[0]
    far = ref[0].copy()
    far[0] -= 3 * lr
    assert not check(far, ref[1])[0]
    ok, out = check(ref[0], ref[1] * 1.05)
    assert not ok and "in loss (FAILED)" in out


def test_ablate_traces_a_configuration_of_its_grid(tmp_path, capsys):
    """The default traced configuration (LLaMA-7B, 4K, 1 GPU, tight) outside a grid: the grid's first takes its
    place, so traces/ is written; a config file's trace that names what the grid lacks, or a budget named
    twice, is a one-line error."""
    out = tmp_path / "rep"
    assert main(["ablate", "--models", "llama-tiny", "--seqs", "128", "--gpus", "2", "--budgets", "roomy=16MiB",
                 "--seeds", "1", "--out", str(out)]) == 0  # fmt: skip
    assert (out / "traces" / "nondet.trace.json").stat().st_size > 0
    assert json.loads((out / "traces" / "meta.json").read_text())["gpus"] == "2"
    assert capsys.readouterr().out.rstrip().endswith("traces/")
    cfg = tmp_path / "c.toml"
    cfg.write_text('[ablate]\nmodels = ["llama-tiny"]\nseqs = [128]\nbudgets = {tight = "1MiB"}\nseeds = 1\n'
                   '[ablate.trace]\nbudget = "nope"\n')  # fmt: skip
    assert main(["ablate", "--config", str(cfg), "--out", str(tmp_path / "r2")]) == 2
    assert "trace budget = 'nope' is not in the grid (tight)" in capsys.readouterr().err
    assert main(["ablate", "--models", "llama-tiny", "--seqs", "128", "--budgets", "a=1MiB", "a=2MiB",
                 "--out", str(tmp_path / "r3")]) == 2  # fmt: skip
    assert "--budgets names 'a' twice" in capsys.readouterr().err


def test_missing_and_foreign_files_say_so(tmp_path, capsys):
    """A plan path that does not exist, a report folder that does not exist, and an .npz holding Python
    objects: each a one-line error that says which."""
    import numpy as np

    assert main(["simulate", str(tmp_path / "nope.tplan")]) == 2
    assert "nope.tplan: no such plan file" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nodir")]) == 2
    assert "nodir: no such directory" in capsys.readouterr().err
    np.savez(tmp_path / "pk.npz", a=np.array([{"x": 1}], dtype=object))
    (tmp_path / "pk.npz").rename(tmp_path / "pk.tplan")
    assert main(["simulate", str(tmp_path / "pk.tplan")]) == 2
    err = capsys.readouterr().err
    assert "not a turnip plan or corrupted (it holds Python objects)" in err and "allow_pickle" not in err


def test_a_budget_error_names_a_tile_to_shrink(tmp_path, capsys):
    """A vertex that cannot fit: the error ends with --tile values that halve its largest tensor's tiled
    dimensions (not the vocabulary tile where a head dimension happens to equal it)."""
    out = str(tmp_path / "t.tplan")
    assert main(["compile", "--model", "llama-tiny", "--seq", "256", "--budget", "16KiB", "-o", out]) == 1
    assert capsys.readouterr().err.rstrip().endswith("or raise the budget (for example --tile t=32).")
    assert main(["compile", "--model", "llama-tiny", "--seq", "256", "--budget", "16KiB", "--tile", "t=32",
                 "-o", out]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "shape (256, 2, 16)" in err and err.rstrip().endswith("(for example --tile h=1).")


def test_flags_that_would_be_ignored_are_errors(tmp_path, capsys):
    """LoRA flags without --train lora, and compile-only flags given with a compiled plan: one-line usage
    errors instead of a run that quietly ignores them."""
    plan = str(tmp_path / "t.tplan")
    assert main(["compile", "--model", "llama-tiny", "--seq", "64", "--budget", "1MiB", "--rank", "8", "-o",
                 plan]) == 2  # fmt: skip
    assert "--rank: only a LoRA training step has it; add --train lora" in capsys.readouterr().err
    assert main(["compile", "--model", "llama-tiny", "--seq", "64", "--budget", "1MiB", "-o", plan]) == 0
    assert main(["simulate", plan, "--batch", "4", "--lr", "0.1"]) == 2
    assert f"--lr, --batch: {plan} is a compiled plan, which fixes them" in capsys.readouterr().err
    assert main(["simulate", "llama-tiny:64:1:1MiB", "--runs", "1", "--train", "lora", "--rank", "8"]) == 0


def test_help_version_and_small_messages(tmp_path, capsys, monkeypatch):
    """--version; help shows defaults only where there is one; a directory given for an output file and a
    misspelt [ablate] table get messages that say so."""
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("turnip ")
    for cmd in ("ablate", "run", "train", "compile", "simulate", "calibrate"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert "(default: None)" not in capsys.readouterr().out, cmd
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "--model", "llama-tiny", "--seq", "32", "--budget", "1MiB", "-o", "t.tplan"]) == 0
    assert main(["run", "t.tplan", "--repeat", "1"]) == 0
    assert "on the h100 profile (" in capsys.readouterr().out  # no efficiency of a CPU run against a GPU's bound
    assert main(["run", "t.tplan", "--trace", str(tmp_path)]) == 2
    assert "is a directory; name a file in it" in capsys.readouterr().err
    (tmp_path / "c.toml").write_text("[ablat]\nseqs = [128]\n")
    assert main(["ablate", "--config", "c.toml", "--out", "r"]) == 2
    assert "no [ablate] table (found [ablat]); did you mean [ablate]?" in capsys.readouterr().err


def test_a_runs_host_speed_against_the_profile_and_the_simulate_command_at_it():
    """``turnip run``'s host speed line: the factor at which the simulator's host thread is as busy as the run's,
    and how to simulate the plan at it."""
    import numpy as np

    from turnip.cli.run_cmds import host_speed_line
    from turnip.compile import compile_model
    from turnip.machine.costs import VertexCosts, host_busy_ns
    from turnip.machine.profile import load_profile

    mg = compile_model("llama-tiny", seq=64, gpus=2, budget="1MiB", resident="auto")[1]
    busy = host_busy_ns(VertexCosts(mg, load_profile("h100-calibrated")), 1.0)

    class Run:
        def host_cost_ns(self):
            return np.full(4, 2.5 * busy / 4)

    line = host_speed_line(mg, "h100-calibrated", Run(), "p.plan")
    assert "2.50x the h100-calibrated profile's host costs" in line
    assert line.endswith("(simulated at it: turnip simulate p.plan --profile h100-calibrated --host-factor 2.50)")
    assert host_speed_line(mg, "h100-calibrated", Run()).endswith("(simulated at it: --host-factor 2.50)")


def test_sustained_kernel_time_is_the_busiest_gpus_kernels_at_the_power_limits_clock():
    """``sustained_kernel_ns``: per GPU, each kernel's model floor times its class's slowdown at the clock the
    power limit sustains (a profile with the shared-clock model), else the model floors; the busiest GPU's sum,
    never below the bound's kernel part."""
    import numpy as np

    from turnip.compile import compile_model
    from turnip.machine.bound import lower_bound, plan_sustained_ns, sustained_kernel_ns
    from turnip.machine.costs import ENG_KERNEL, VertexCosts, cost_class
    from turnip.machine.profile import load_profile

    mg = compile_model("llama-tiny", seq=64, gpus=2, budget="1MiB", resident="auto")[1]
    for name in ("h100-calibrated", "h100"):
        prof = load_profile(name)
        c = VertexCosts(mg, prof)
        k = np.flatnonzero(c.eng == ENG_KERNEL)
        slow = {"gemm": prof.power_slow_gemm, "attention": prof.power_slow_attn, "memory": prof.power_slow_memory}
        w = [slow[cost_class(mg.op[v])] if prof.power_slow_gemm > 0 else 1.0 for v in k]
        want = max(sum(f * x for f, x, g in zip(c.floor_ns()[k], w, mg.gpu[k], strict=True) if g == gpu)
                   for gpu in range(2))  # fmt: skip
        got = sustained_kernel_ns(c)
        assert abs(got - want) <= 1 and got == plan_sustained_ns(mg, name)
        assert got >= lower_bound(c)["kernel_ns"]
    assert load_profile("h100-calibrated").power_slow_gemm > 1.0  # the clock model is there to apply


def test_a_gpu_runs_report_shows_the_bound_and_the_sustained_kernel_time(capsys):
    """``turnip run``'s summary on a GPU: the bound with the run's efficiency, then the busiest GPU's kernels at the
    clock the power limit sustains and the run's share of it, then a run faster than its bound flagged."""
    import numpy as np

    from turnip.cli.run_cmds import _report

    class Res:
        def command_host_cost_ns(self):
            return np.array([10_000.0, 20_000.0])

    row = {"input_nbytes": 1 << 30, "reload_nbytes": 0, "offload_nbytes": 0, "transfer_nbytes": 0, "gpu_busy_frac": 0.9}
    rows = [row | {"makespan_ns": ms * 1_000_000} for ms in (1000, 1200, 1100)]
    bound = {"critical_path_ns": 400_000_000, "kernel_ns": 700_000_000, "link_ns": 500_000_000, "host_ns": 80_000_000,
             "lower_bound_ns": 700_000_000}  # fmt: skip
    _report(rows, bound, Res(), profile="h100-calibrated", sustained_ns=990_000_000)
    out = capsys.readouterr().out
    assert "lower bound          700.000 ms on the h100-calibrated profile" in out and "efficiency 0.636" in out
    assert "kernels sustained    990.000 ms" in out and "the run at 0.900 of it" in out
    assert "warning" not in out
    _report([row | {"makespan_ns": 600_000_000}], bound, Res(), sustained_ns=990_000_000)
    assert "less than its lower bound" in capsys.readouterr().out
