"""``turnip calibrate``: measure this GPU into a machine profile for the simulator.

The measuring (``turnip.calibrate``) and the fit of the GPU-wide effects, which simulates the recorded plans
(``sim.fit``), meet here: this layer passes the fit to the measuring, which never imports the simulator.
"""

from __future__ import annotations

import json
from pathlib import Path

from turnip.cli import USAGE, CliError, DefaultsHelp
from turnip.cli import args as ck

REFIT_NEEDS = "--refit needs a profile written by `turnip calibrate` (JSON with its measurements)"


def register(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this GPU (kernels over shapes, copies, host costs) into a machine profile",
        description="Run small LLaMA-family plans on the CUDA backend at a sweep of prompt lengths and tile "
        "sizes (one stream with start events, every weight resident: each vertex's device time is its kernel "
        "alone; then every stream slot: host issue and completion costs per op, and makespans to which the "
        "concurrency factor is fitted), the power limit's shared clock (the largest GEMM, attention and "
        "memory-bound kernels looped back to back, alone and mixed, with NVML power readings), copies of pinned "
        "memory by size and direction alone and against traffic the other way (and with several GPUs, the host "
        "link's totals with 1..N of them copying at once); write a JSON profile with "
        "shape-aware kernel and copy tables and their spread (docs/profile.md). Use it with "
        "`turnip simulate/ablate --profile FILE`. "
        "About 3 minutes on an H100 (--quick: about half). --refit redoes the fit from a profile, no GPU.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.json", help="profile file to write")
    p.add_argument("--dtypes", nargs="+", default=["fp16"], choices=ck.DTYPES, help="compute dtypes to measure")
    p.add_argument("--quick", action="store_true", help="half the plans, fewer repeats and copy sizes")
    p.add_argument("--p2p", action="store_true",
                   help="also time peer copies GPU 0 -> GPU 1 by size (two GPUs needed): the profile's p2p rate, "
                        "latency and table; with three or more GPUs, whether a GPU's NVLink ports take one copy at "
                        "a time each way (p2p_ports_serial); opt-in until measured on a GPU pair")
    p.add_argument("--refit", metavar="PROFILE.json", help="no GPU: refit the concurrency factor and power-limit rates "
                   "of a profile `turnip calibrate` wrote (to its recorded plan makespans), write it to --output")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(a) -> int:
    from turnip.calibrate import calibrate, write_profile
    from turnip.cli.run_cmds import _cuda_preflight
    from turnip.progress import Progress

    _json_output(a.output)
    ck.output_file(a.output, "--output")
    if a.refit:
        from sim.fit import refit

        _refit_input(a.refit)
        write_profile(refit(a.refit), a.output)
        print(f"profile   {a.output}: refitted from {a.refit}")
        return 0
    _cuda_preflight("turnip calibrate", "or simulate with a shipped profile (--profile h100-calibrated)")
    from sim.fit import fit_gpu_effects  # the fit simulates the recorded plans: measuring never imports sim

    doc = calibrate(tuple(a.dtypes), a.quick, progress_factory=Progress, p2p=a.p2p, fit=fit_gpu_effects)
    write_profile(doc, a.output)
    m = doc["machine"]
    print(f"profile   {a.output}: {len(doc['kernels'])} kernel points, {len(doc['copies'])} copy points, "
          f"{doc['calibration']['seconds']:.0f} s")  # fmt: skip
    print(f"links     H2D {m['h2d_bytes_per_s'] / 1e9:.1f} GB/s, D2H {m['d2h_bytes_per_s'] / 1e9:.1f} GB/s, both "
          f"{m['pcie_both_bytes_per_s'] / 1e9:.1f} GB/s, latency {m['copy_latency_ns'] / 1e3:.1f} us")  # fmt: skip
    if m.get("host_h2d_total_bytes_per_s"):
        cols = [m[f"host_{k}_total_bytes_per_s"] for k in ("h2d", "d2h", "both")]
        tot = [f"{n + 1}: " + "/".join(f"{c[n] / 1e9:.0f}" for c in cols) for n in range(len(cols[0]))]
        print(f"host link GB/s in total with N GPUs copying at once (H2D/D2H/both): {', '.join(tot)}")
    print(f"host      issue: GEMM {m['gemm_launch_ns'] / 1e3:.1f} us, attention {m['attn_launch_ns'] / 1e3:.1f} us, "
          f"other kernels {m['kernel_launch_ns'] / 1e3:.1f} us, copies {m['copy_launch_ns'] / 1e3:.1f} us; "
          f"completion {m['completion_ns'] / 1e3:.1f} us + {m.get('completion_per_inflight_ns', 0) / 1e3:.2f} us per "
          "vertex in flight")  # fmt: skip
    return 0


def _json_output(path: str) -> None:
    """``CliError`` (usage) unless ``path`` ends in ``.json``: the profile is a JSON document (its tables and
    measurements have no TOML form), and ``load_profile`` reads any other name as TOML."""
    if Path(path).suffix != ".json":
        raise CliError(f"--output {path}: `turnip calibrate` writes a JSON profile (its tables have no TOML form); "
                       "name it *.json", USAGE)  # fmt: skip


def _refit_input(path: str) -> None:
    """``CliError`` (usage), before the fit, unless ``path`` is a JSON profile with the plan makespans that
    ``sim.fit.refit`` fits to (``calibration.plans``, which only ``turnip calibrate`` writes: TOML
    profiles and the shipped presets hold fitted fields, not measurements)."""
    from turnip.machine.profile import load_profile

    p = Path(path)
    if not p.is_file():
        why = "is a directory" if p.is_dir() else "no such file"
        raise CliError(f"--refit {path}: {why}; pass the path of a profile `turnip calibrate -o` wrote "
                       "(e.g. turnip/machine/profiles/h100-calibrated.json)", USAGE)  # fmt: skip
    if p.suffix != ".json":
        raise CliError(f"{path}: {REFIT_NEEDS}; a {p.suffix or 'suffix-less'} profile carries no measurements",
                       USAGE)  # fmt: skip
    try:
        load_profile(p)
        doc = json.loads(p.read_text())
    except (ValueError, TypeError, OSError) as e:  # invalid JSON, unknown fields, bad values, unreadable
        raise CliError(f"{e}; {REFIT_NEEDS}", USAGE) from None
    cal = doc.get("calibration") if isinstance(doc, dict) else None
    plans = cal.get("plans") if isinstance(cal, dict) else None
    if not isinstance(plans, list) or not any(isinstance(q, dict) and q.get("nondet_ms") for q in plans):
        raise CliError(f"{path}: {REFIT_NEEDS}; it records no plan makespans to fit to (a profile by hand, a "
                       "conversion, or an older `turnip calibrate`?)", USAGE)  # fmt: skip
