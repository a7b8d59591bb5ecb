"""``turnip calibrate``: measure this GPU and write a machine profile the simulator can use (``docs/profile.md``).

Three measurements, all through the code a real run uses:

- **kernels**: small LLaMA-family plans (one or two decoder layers, every weight resident, LM heads) at a
  sweep of prompt lengths and tile sizes run on the CUDA backend with one stream per GPU and the ``det``
  policy, so each vertex's device interval (CUDA events around its launch) is its kernel alone, timed after
  HEAT_S seconds of back-to-back runs (GPU clocks under sustained load, as in a long prefill). Vertices
  are grouped by (op, einsum subscripts or ``*``, dtype, work), work being flops for ``einsum``, ``sdpa``
  and ``sdpa_bwd`` and bytes read plus written for the others; each group gives its mean, standard deviation
  and count over every vertex and run. Different tile sizes give each op a curve over work.
- **copies**: host-to-device and device-to-host copies of pinned memory from 64 KiB to 512 MiB, alone and
  while the other direction streams, timed with events on their own streams.
- **host costs**: a streamed plan run with the default stream slots and ``nondet``: median issue time per
  kind of vertex (GEMM, attention, other kernel, copy) and median completion handling.

The profile is JSON: ``machine`` (scalar fields of ``MachineProfile``, the host and link figures measured
here), ``kernels`` and ``copies`` (the tables). Plans used for validation (``benchmarks/sim_vs_real.py``)
are full models at other prompt lengths: calibration never runs them.
"""

from __future__ import annotations

import json
import platform
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

GiB = 1 << 30
HEAT_S = 1.5  # seconds of back-to-back runs of a plan before its timed runs


@dataclass(frozen=True)
class KernelPlan:
    """One calibration plan: a model (preset or config path), prompt length, tiles, layers, LM head."""

    model: str
    seq: int
    tiles: dict
    layers: int = 1
    head: str = "none"
    batch: int = 0  # > 0: a LoRA training step of this many sequences of ``seq`` tokens (rank 16, q,k,v,ffn)


def kernel_plans(quick: bool = False) -> list[KernelPlan]:
    """Prompt lengths and tiles chosen apart from the validation grid's defaults (1K..32K, default tiles):
    token tiles 512..8192, head blocks of 4..16 heads, FFN blocks of 1376..5504 columns, key ranges split or
    whole, grouped-query layers (LLaMA-3-8B shapes) and LM heads."""
    from pathlib import Path

    gqa = str(Path(__file__).resolve().parent.parent / "benchmarks" / "configs" / "llama3-8b.json")
    plans = [
        KernelPlan("llama-7b", 3072, {"t": 512, "h": 8, "f": 1376}),
        KernelPlan("llama-7b", 6144, {"t": 1536, "h": 16, "f": 2752}),
        KernelPlan("llama-7b", 12288, {"t": 3072, "h": 16, "f": 5504}),
        KernelPlan("llama-7b", 12288, {"t": 6144, "h": 4, "f": 5504, "kv": 6144}),
        KernelPlan("llama-7b", 24576, {"t": 8192, "h": 8, "f": 2752}),
        KernelPlan("llama-7b", 2560, {"t": 2560, "h": 16, "f": 11008}, head="last"),
    ]
    if Path(gqa).exists():
        plans += [KernelPlan(gqa, 6144, {"t": 2048, "h": 4, "f": 7168, "v": 32064}, head="last"),
                  KernelPlan(gqa, 20480, {"t": 5120, "h": 4, "f": 3584})]  # fmt: skip
    # training steps (their backward ops, LoRA's small GEMMs, the loss, Adam) at sequence lengths and head/FFN
    # blocks apart from the training benchmark's (1K and 4K sequences, whole heads and FFN)
    # (two layers: the second's backward goes through the frozen projections to the first's input; one long
    # sequence: attention's backward at the tile sizes long training sequences use)
    plans += [KernelPlan("llama-7b", 1536, {"h": 16, "f": 5504}, layers=2, batch=3),
              KernelPlan("llama-7b", 2560, {"h": 8, "f": 2752}, layers=2, batch=2),
              KernelPlan("llama-7b", 6144, {"h": 16, "f": 5504}, layers=2, batch=1)]  # fmt: skip
    return plans[::2] if quick else plans


def _kernel_samples(mg, runs, into: dict) -> dict:
    """Add every kernel vertex's device durations over ``runs`` to ``into``, grouped by (op, match, dtype,
    work); returns ``into``."""
    from turnip.machine.costs import vertex_match, vertex_work
    from turnip.memgraph.plan import KIND_KERNEL

    work, match = vertex_work(mg), vertex_match(mg)
    for v in np.flatnonzero(mg.kind == KIND_KERNEL):
        key = (mg.op[v], match[v], mg.dtype[v], float(work[v]))
        g = into.setdefault(key, {"ns": [], "shape": "x".join(map(str, mg.shape[v]))})
        g["ns"].extend(int(r.end_ns[v] - r.start_ns[v]) for r in runs)
    return into


def _rows(samples: dict) -> list[dict]:
    """One table row per group of samples: mean and sd of the durations, sorted by key."""
    rows = []
    for (op, match, dtype, w), g in sorted(samples.items()):
        ns = np.array(g["ns"], dtype=np.float64)
        rows.append({"op": op, "match": match, "dtype": dtype, "work": w, "ns_mean": float(ns.mean()),
                     "ns_sd": float(ns.std(ddof=1)) if ns.size > 1 else 0.0, "n": int(ns.size),
                     "shape": g["shape"]})  # fmt: skip
    return rows


def _kernel_rows(mg, runs) -> list[dict]:
    """The table rows of one plan's runs."""
    return _rows(_kernel_samples(mg, runs, {}))


def dependency_gaps(mg, runs) -> list[tuple[str, int]]:
    """(kind, ns) for every kernel that found its GPU idle: device time from its last dependency's end to
    its own start (the host saw the completion, handled it, issued the kernel, the device started it).
    Kind: ``gemm``, ``attn`` or ``kernel`` (the host's launch cost differs)."""
    from turnip.machine.costs import cost_class
    from turnip.memgraph.plan import KIND_KERNEL

    kern = np.flatnonzero(mg.kind == KIND_KERNEL)
    out = []
    for r in runs:
        order = kern[np.argsort(r.start_ns[kern], kind="stable")]
        prev_end = 0
        for v in order:
            deps = mg.deps(int(v))
            ready = int(r.end_ns[deps].max()) if len(deps) else 0
            s0 = int(r.start_ns[v])
            if deps.size and ready >= prev_end and s0 >= ready:  # idle GPU, waiting on this kernel's inputs
                cls = cost_class(mg.op[v])
                out.append(("gemm" if cls == "gemm" else "attn" if cls == "attention" else "kernel", s0 - ready))
            prev_end = max(prev_end, int(r.end_ns[v]))
    return out


def measure_kernels(plans: list[KernelPlan], dtype: str = "fp16", repeat: int = 3, progress=None,
                    gaps: list | None = None, run_cvs: list | None = None) -> list[dict]:  # fmt: skip
    from turnip.compile import build_with_resident, make_taskgraph
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import iter_random_inputs, write_streaming

    samples: dict = {}
    for i, p in enumerate(plans):
        train = None
        if p.batch:
            from turnip.train import TrainSpec

            train = TrainSpec(p.batch, checkpoint="on")
        tg = make_taskgraph(p.model, p.seq, 1, dtype, p.tiles, n_layers=p.layers, head=p.head, train=train)
        inputs = int(sum(int(np.prod(tg.shape[v])) for v in np.flatnonzero(tg.kind == 0))) * 4
        budget = 3 * inputs + (4 << 30)
        mg = build_with_resident(tg, budget, None, str(inputs + (1 << 20)))
        with open_backend("cuda", mg, 1) as be:
            write_streaming(be, tg, iter_random_inputs(tg, seed=i))
            execute(mg, be, "det", 1, seed=0)  # warm-up: modules, handles, graphs
            t_heat = time.perf_counter()  # then sustained load, so clocks settle where long prefills run them
            while time.perf_counter() - t_heat < HEAT_S:
                execute(mg, be, "det", 1, seed=0)
            runs = [execute(mg, be, "det", 1, seed=r) for r in range(repeat)]
        if gaps is not None:
            gaps.extend(dependency_gaps(mg, runs))
        if run_cvs is not None and len(runs) > 1:  # run-to-run spread of the whole plan
            ms = np.array([r.makespan_ns for r in runs], dtype=np.float64)
            run_cvs.append(float(ms.std(ddof=1) / ms.mean()))
        _kernel_samples(mg, runs, samples)
        if progress:
            progress(i + 1)
    return _rows(samples)


def measure_copies(sizes: list[int], repeat: int = 10) -> list[dict]:
    """H2D and D2H copies of pinned memory, alone and against a stream of copies the other way."""
    from cuda_kernels._numba import cuda
    from turnip.runtime._cudadrv import Driver

    c = cuda()
    drv = Driver()
    big = max(sizes)
    host = [drv.host_alloc(big, False), drv.host_alloc(big, False)]
    dev = [c.device_array(big, dtype=np.uint8), c.device_array(big, dtype=np.uint8)]
    dptr = [int(d.__cuda_array_interface__["data"][0]) for d in dev]
    s_main, s_other = c.stream(), c.stream()
    hm, ho = int(s_main.handle), int(s_other.handle)
    ev = [(drv.event(), drv.event()) for _ in range(repeat)]

    def copy(kind: str, nbytes: int, stream: int, k: int = 0) -> None:
        if kind == "h2d":
            drv.check(drv.cuMemcpyHtoDAsync_v2(dptr[k], host[k], nbytes, stream), "h2d")
        else:
            drv.check(drv.cuMemcpyDtoHAsync_v2(host[k], dptr[k], nbytes, stream), "d2h")

    rows = []
    try:
        for kind in ("h2d", "d2h"):
            other = "d2h" if kind == "h2d" else "h2d"
            for contended in (False, True):
                for n in sizes:
                    copy(kind, n, hm)  # warm-up
                    drv.check(drv.cuStreamSynchronize(hm), "sync")
                    if contended:  # keep the other direction busy for the whole measurement
                        total = n * repeat * 2 + (64 << 20)
                        chunk = min(big, 64 << 20)
                        for _ in range(max(2, total // chunk)):
                            copy(other, chunk, ho, 1)
                    for e0, e1 in ev:
                        drv.check(drv.cuEventRecord(e0, hm), "event")
                        copy(kind, n, hm)
                        drv.check(drv.cuEventRecord(e1, hm), "event")
                    drv.check(drv.cuStreamSynchronize(hm), "sync")
                    drv.check(drv.cuStreamSynchronize(ho), "sync")
                    ns = np.array([drv.elapsed_ms(e0, e1) * 1e6 for e0, e1 in ev])
                    rows.append({"kind": kind, "contended": contended, "nbytes": int(n), "ns_mean": float(ns.mean()),
                                 "ns_sd": float(ns.std(ddof=1)), "n": int(ns.size)})  # fmt: skip
    finally:
        for e0, e1 in ev:
            drv.cuEventDestroy_v2(e0)
            drv.cuEventDestroy_v2(e1)
        for p in host:
            drv.cuMemFreeHost(p)
        del dev
    return rows


def measure_host(dtype: str = "fp16", repeat: int = 3) -> dict:
    """Median host cost per vertex kind of a streamed plan (issue) and of completion handling."""
    from turnip.compile import build_with_resident, make_taskgraph
    from turnip.machine.costs import cost_class
    from turnip.memgraph.plan import KIND_KERNEL
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import iter_random_inputs, write_streaming

    tg = make_taskgraph("llama-7b", 3072, 1, dtype, {"t": 1024}, n_layers=2, budget_nbytes=1 << 30)
    mg = build_with_resident(tg, 1 << 30, None, "0")
    with open_backend("cuda", mg, 5) as be:
        write_streaming(be, tg, iter_random_inputs(tg, seed=0))
        execute(mg, be, "nondet", 5, seed=0)
        runs = [execute(mg, be, "nondet", 5, seed=r) for r in range(repeat)]
    issue = np.concatenate([r.issue_ns - r.host_start_ns for r in runs])
    handle = np.concatenate([r.handle_ns for r in runs])
    op = np.tile(np.asarray([cost_class(o) for o in mg.op], dtype=object), len(runs))
    kernel = np.tile(mg.kind == KIND_KERNEL, len(runs))
    dispatched = np.concatenate([r.issue_ns > 0 for r in runs])

    def med(sel) -> int:
        sel = sel & dispatched
        return int(np.median(issue[sel])) if sel.any() else 0

    return {
        "gemm_launch_ns": med(kernel & (op == "gemm")),
        "attn_launch_ns": med(kernel & (op == "attention")),
        "kernel_launch_ns": med(kernel & (op == "memory")),
        "copy_launch_ns": med(~kernel),  # inputs streamed from the host, reloads, offloads
        "completion_ns": int(np.median(handle[dispatched])),
    }


def copy_fields(copies: list[dict]) -> dict:
    """Link figures for the profile's scalar fields from the copy table: bandwidths of the largest copies,
    latency of the smallest, total of both directions at once."""
    def rate(kind, contended):
        r = max((x for x in copies if x["kind"] == kind and x["contended"] == contended), key=lambda x: x["nbytes"])
        return r["nbytes"] / r["ns_mean"] * 1e9

    small = min(copies, key=lambda x: (x["nbytes"], x["ns_mean"]))
    return {"h2d_bytes_per_s": rate("h2d", False), "d2h_bytes_per_s": rate("d2h", False),
            "pcie_both_bytes_per_s": rate("h2d", True) + rate("d2h", True),
            "copy_latency_ns": int(small["ns_mean"])}  # fmt: skip


def calibrate(dtypes=("fp16",), quick: bool = False, progress_factory=None, log=print) -> dict:
    """Run every measurement; returns the profile document."""
    t0 = time.perf_counter()
    plans = kernel_plans(quick)
    kernels: list[dict] = []
    gaps: list = []
    run_cvs: list = []
    for dt in dtypes:
        bar = progress_factory(len(plans), f"calibrate: kernels ({dt})") if progress_factory else nullcontext()
        with bar:
            kernels += measure_kernels(plans, dt, repeat=2 if quick else 3, progress=getattr(bar, "update", None),
                                       gaps=gaps, run_cvs=run_cvs)  # fmt: skip
    log(f"kernels: {len(kernels)} (op, shape) points from {len(plans)} plans x {len(dtypes)} dtypes, "
        f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    sizes = [1 << k for k in range(16, 30, 1 if not quick else 2)]
    copies = measure_copies(sizes, repeat=5 if quick else 10)
    log(f"copies: {len(copies)} points, {time.perf_counter() - t0:.0f} s")
    host = measure_host(dtypes[0], repeat=2 if quick else 3)
    log(f"host costs: {host}, {time.perf_counter() - t0:.0f} s")
    from cuda_kernels._numba import cuda

    name = cuda().get_current_device().name
    name = name.decode() if isinstance(name, bytes) else str(name)
    launch = {"gemm": host["gemm_launch_ns"], "attn": host["attn_launch_ns"], "kernel": host["kernel_launch_ns"]}
    residual = [g - host["completion_ns"] - launch[k] for k, g in gaps]
    latency = max(0, int(np.median(residual))) if residual else 0  # what the host costs do not explain
    log(f"kernel start latency: {latency} ns (median over {len(residual)} hand-overs to an idle GPU)")
    cv = float(np.median(run_cvs)) if run_cvs else 0.0  # a run-wide factor with this mean and spread
    machine = {"name": f"calibrated {name}", "kernel_start_latency_ns": latency, "run_excess_mean": cv,
               "run_excess_sd": cv} | host | copy_fields(copies)  # fmt: skip
    return {"format": "turnip-profile", "version": 1, "machine": machine, "kernels": kernels, "copies": copies,
            "calibration": {"device": name, "host": platform.node(), "seconds": round(time.perf_counter() - t0, 1),
                            "plans": [p.__dict__ | {"model": p.model.rsplit("/", 1)[-1]} for p in plans],
                            "dtypes": list(dtypes)}}  # fmt: skip


def write_profile(doc: dict, path: str) -> None:
    from turnip.fileio import atomic_write

    with atomic_write(path) as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
