"""Exit status of multi-GPU runs: `turnip run` and `turnip train` in subprocesses, and where a process that
ends badly ends.

    python benchmarks/exit_check.py cmds --gpus 2 --out exit.csv   # each command: exit code, stderr's last lines
    python benchmarks/exit_check.py probe --gpus 2                 # a training run in this process, then the
                                                                   #   teardown step by step (markers on stderr)
    python benchmarks/exit_check.py numba --gpus 2                 # one numba kernel on every GPU, then exit

`probe` prints a marker before each teardown step (library caches, handles, garbage collection), so that
with ``PYTHONFAULTHANDLER=1 MALLOC_CHECK_=3`` an abort names the step it happened in (faulthandler prints
the Python stack on SIGABRT). A clean process prints every marker and exits 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

BAD = ("double free", "corrupted", "free():", "malloc():", "Segmentation fault", "Aborted", "Traceback",
       "Fatal Python error")  # fmt: skip


def _turnip(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from turnip.cli import main; sys.exit(main(sys.argv[1:]))", *args]


def commands(gpus: int, layers: int) -> list[tuple[str, list[str], dict]]:
    """(label, argv, extra environment) of the runs whose exit is checked."""
    train = ["train", "--model", "llama-7b", "--layers", str(layers), "--batch", "2", "--seq", "1024", "--budget",
             "16GiB", "--backend", "cuda", "--steps", "2"]  # fmt: skip
    run = ["run", "--model", "llama-7b", "--seq", "2048", "--budget", "16GiB", "--backend", "cuda", "--repeat", "2"]
    diag = {"PYTHONFAULTHANDLER": "1", "MALLOC_CHECK_": "3"}
    out = [(f"train {gpus} GPUs", _turnip(*train, "--gpus", str(gpus)), {}),
           (f"train {gpus} GPUs, MALLOC_CHECK_=3", _turnip(*train, "--gpus", str(gpus)), diag),
           (f"run {gpus} GPUs, MALLOC_CHECK_=3", _turnip(*run, "--gpus", str(gpus)), diag)]  # fmt: skip
    return out


def cmd_cmds(a) -> int:
    rows = []
    for label, argv, env in commands(a.gpus, a.layers):
        t0 = time.perf_counter()
        p = subprocess.run(argv, capture_output=True, text=True, env=os.environ | env, timeout=a.timeout)
        bad = [b for b in BAD if b in p.stderr]
        tail = " | ".join(p.stderr.strip().splitlines()[-6:])
        rows.append({"run": label, "rc": p.returncode, "seconds": round(time.perf_counter() - t0, 1),
                     "stderr_bad": ";".join(bad), "stderr_tail": tail[-1500:]})  # fmt: skip
        print(f"{label:42s} rc {p.returncode:4d}  {rows[-1]['seconds']:6.1f} s  {';'.join(bad)}", flush=True)
        if p.returncode or bad:
            print("   stderr: " + tail[-1500:], flush=True)
            print("   stdout: " + " | ".join(p.stdout.strip().splitlines()[-3:]), flush=True)
    if a.out:
        from multi_gpu import write_csv  # a sibling script

        write_csv(a.out, rows)
    return 0


def _mark(*what) -> None:
    print("MARK", *what, file=sys.stderr, flush=True)


def cmd_probe(a) -> int:
    import faulthandler
    import gc

    faulthandler.enable()
    from turnip.cli import main

    _mark("start")
    argv = ["train", "--model", "llama-7b", "--layers", str(a.layers), "--batch", "2", "--seq", "1024", "--budget",
            "16GiB", "--backend", "cuda", "--steps", "2", "--gpus", str(a.gpus)]  # fmt: skip
    import cuda_kernels.kernels as kernels

    prepare, paths = kernels.prepare, set()

    def spy(op, *args, **kw):  # which implementation each op of the plan takes
        lau = prepare(op, *args, **kw)
        paths.add((op, lau.path))
        return lau

    kernels.prepare = spy
    rc = main(argv)
    _mark("training returned", rc, "ops by path:", sorted(paths))
    import cuda_kernels.cudnn_sdpa as cs

    _mark("cudnn graphs", len(cs._GRAPHS), "build handles on devices", sorted(cs._BUILD_HANDLES))
    cs._GRAPHS.clear()
    gc.collect()
    _mark("cudnn graphs dropped")
    cs.release()
    _mark("cudnn build handles destroyed")
    import cuda_kernels.cublaslt as lt

    lt._release_heuristic_handles()
    _mark("cublaslt heuristic handles destroyed")
    gc.collect()
    _mark("garbage collected; exiting")
    return 0


def cmd_numba(a) -> int:
    import numpy as np

    from cuda_kernels._numba import cuda
    from cuda_kernels.launch import current_device, driver, launch_raw

    c = cuda()

    @c.jit
    def inc(x):
        i = c.grid(1)
        if i < x.size:
            x[i] += 1.0

    for d in range(a.gpus):
        with c.gpus[d]:
            x = c.to_device(np.zeros(64, np.float32))
            inc[1, 64](x)
            c.synchronize()
            _mark("dispatcher launch on device", d, x.copy_to_host()[:2], "current", current_device())
    # as the runtime binds them: compile once, take the function handle in each device's context
    from cuda_kernels._numba import Compiled, array_type

    k = Compiled(inc, (array_type(np.float32, 1),), 1, 64)
    for d in range(a.gpus):
        with c.gpus[d]:
            x = c.to_device(np.zeros(64, np.float32))
            raw = k.bind((x,))
            s = c.stream()
            r = launch_raw(raw, int(s.handle))
            s.synchronize()
            _mark("bound launch on device", d, "rc", r, x.copy_to_host()[:2])
    del driver
    _mark("exiting")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["cmds", "probe", "numba"])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    return {"cmds": cmd_cmds, "probe": cmd_probe, "numba": cmd_numba}[a.what](a)


if __name__ == "__main__":
    raise SystemExit(main())
