"""Tampered plan files against the CUDA backend: each must be refused before anything touches the GPU.

    python benchmarks/tampered_plans.py make DIR     # a good llama-tiny plan and five tampered copies (any machine)
    python benchmarks/tampered_plans.py check DIR    # on a GPU: `turnip run` each under compute-sanitizer

The tampered copies (checksums recomputed, so only the checks can catch them): a kernel's output moved to
10^9 (outside its arena), a copy's size doubled, a host offset past its region, a vertex on GPU 7 of a
one-GPU plan, an edge to a vertex that does not exist. ``check`` runs ``turnip run PLAN --backend cuda``, then
the same under ``compute-sanitizer --tool memcheck`` (where the tool is found): the good plan must exit 0 and
run clean; each tampered one must end in one ``error:`` line with exit 2, and under the sanitizer make no CUDA
call at all ("terminated before first instrumented API call": refused before the first driver call) or
report no error. Prints one line per plan and exits 1 if any plan does otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CLI = "import sys; from turnip.cli import main; sys.exit(main(sys.argv[1:]))"


def tamper(mg, how: str) -> None:
    """Change ``mg`` in place the way ``how`` names."""
    from turnip.memgraph.plan import KIND_INPUT, KIND_KERNEL

    kernel = next(v for v in range(mg.n) if mg.kind[v] == KIND_KERNEL)
    copy = next(v for v in range(mg.n) if mg.kind[v] == KIND_INPUT and not mg.preloaded()[v])
    if how == "offset":
        mg.out_offset[kernel] = 10**9
    elif how == "size":
        mg.out_nbytes[copy] *= 2
    elif how == "host":
        mg.host_offset[copy] = 1 << 40
    elif how == "gpu":
        mg.gpu[kernel] = 7
    elif how == "edge":
        mg.dep_src[len(mg.dep_src) // 2] = mg.n + 5
    else:
        raise ValueError(how)


HOW = ("offset", "size", "host", "gpu", "edge")


def make(out: Path) -> None:
    from turnip.compile import compile_model
    from turnip.memgraph.io import load_plan, save_plan

    out.mkdir(parents=True, exist_ok=True)
    tg, mg = compile_model("llama-tiny", seq=64, budget="300KiB", resident="0")
    save_plan(out / "good.tplan", mg, tg)
    for how in HOW:
        mg, tg = load_plan(out / "good.tplan")
        tamper(mg, how)
        save_plan(out / f"tampered_{how}.tplan", mg, tg)
    print(f"wrote {out}/good.tplan and {len(HOW)} tampered copies")


def check(out: Path) -> int:
    san = shutil.which("compute-sanitizer")
    bad = 0
    for plan in sorted(out.glob("*.tplan")):
        good = plan.stem == "good"
        cmd = [sys.executable, "-c", CLI, "run", str(plan), "--backend", "cuda", "--repeat", "1"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        err = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        ok = p.returncode == 0 if good else (p.returncode == 2 and len(err) == 1 and "Traceback" not in p.stderr)
        verdict = ""
        if san:  # again under the sanitizer: no memory error; a refused plan makes no CUDA call at all
            s = subprocess.run([san, "--tool", "memcheck", "--error-exitcode", "99", *cmd], capture_output=True,
                               text=True, timeout=600)  # fmt: skip
            text = s.stdout + s.stderr
            untouched = "terminated before first instrumented API call" in text
            clean = "ERROR SUMMARY: 0 errors" in text
            verdict = "no CUDA call" if untouched else "0 errors" if clean else "sanitizer: errors or no summary"
            ok = ok and (clean and s.returncode == 0 if good else untouched or clean)
        bad += not ok
        line = err[0] if err else ''
        print(f"{plan.name:28s} exit {p.returncode:3d} {'ok' if ok else 'FAILED'}  [{verdict}]  {line}")
        if not ok:
            print("   " + " | ".join((p.stdout + p.stderr).strip().splitlines()[-6:]))
    print(f"compute-sanitizer: {san or 'not found (plain runs)'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("make", "check"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[1])
    if argv[0] == "make":
        make(out)
        return 0
    return check(out)


if __name__ == "__main__":
    raise SystemExit(main())
