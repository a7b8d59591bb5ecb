"""``turnip calibrate``: measure this GPU and write a machine profile the simulator can use (``docs/profile.md``).

Measurements, all through the code a real run uses:

- **kernels**: small LLaMA-family plans (one, two or eight decoder layers, every weight resident, LM heads,
  LoRA training steps) at a sweep of prompt lengths and tile sizes run on the CUDA backend with one stream
  and the ``det`` policy, with start and end events around every vertex, so each device interval is its
  kernel alone, each timed run after REST_S seconds idle: kernels at full clock (the power limit is the
  simulator's, fitted below). Vertices are grouped by (op, einsum
  subscripts or ``*``, dtype, work), work being flops for ``einsum``, ``sdpa`` and ``sdpa_bwd`` and bytes
  read plus written for the others; each group gives its mean, standard deviation and count.
- **host costs**: the same plans without start events on every stream slot under ``nondet``: issue time per
  op (the ``launch`` table) and per class, completion handling (a line in the commands the completion hands
  back to issue: ``handle_ns`` + ``handle_per_cmd_ns`` x commands), the delay from a kernel's
  end to the host loop seeing it while idle, a line in the number of vertices in flight (the loop queries
  each one's end event in turn: ``completion_ns`` + ``completion_per_inflight_ns`` x in flight); the start
  latency of a kernel launched on an idle GPU from the one-stream runs; copies' issue cost from the probe's
  streamed plan.
- **copies**: host-to-device and device-to-host copies of pinned memory from 64 KiB to 512 MiB, alone and
  while the other direction streams, timed with events on their own streams.
- **power** (``measure_power``): the largest GEMM, attention and memory-bound kernels back to back on one
  stream, alone and mixed, and a GEMM with a sleeping kernel, each for POWER_LOOP_S after a rest, in
  POWER_REPEATS rounds (each kernel's time, the power and the clock: their median over the rounds), with NVML
  power readings: how the clock the power limit sets slows each class, and what each draws (the shared-clock
  fields of ``MachineProfile``).
- **the host's wander** (``HostProbe``): a streamed plan loaded for the whole calibration and run once after
  each plan and stage: how much the host's issue time and its link's rate change between runs over minutes
  (``host_excess_sd``, ``link_excess_sd``, ``host_link_corr``: ``probe_fields``); its last runs give the
  copies' issue cost.
- **GPU-wide effects**: each plan's makespans back to back on every stream slot after SUSTAIN_S seconds of
  it, and the host's idle time between two of them (``calibration.plans``, ``run_gap_ns``);
  ``sim.fit.fit_gpu_effects`` (passed in by the CLI: measuring never imports the simulator) fits the
  concurrency factor and the flop rates GEMMs and attention sustain at the power limit (one fraction of each
  class's best full-clock rate) to them (``turnip calibrate --refit``, ``sim.fit.refit``, does it again from
  the file). The plans and their graphs are ``turnip.calplans``' (the fit replays them too).

The profile is JSON: ``machine`` (scalar fields of ``MachineProfile``, the host and link figures measured
here), ``kernels`` and ``copies`` (the tables). Plans used for validation (``benchmarks/sim_vs_real.py``)
are full models at other prompt lengths: calibration never runs them.
"""

from __future__ import annotations

import json
import platform
import time
import warnings
from contextlib import nullcontext

import numpy as np

from turnip.calplans import KernelPlan, kernel_plans, plan_graph

GiB = 1 << 30
REST_S = 0.25  # seconds idle before each run timed for the kernel tables (clocks back at full speed)
SUSTAIN_S = 1.0  # seconds of back-to-back nondet runs before the timed ones (the power limit's steady state)


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


def _launch_kind(op: str) -> str:
    """``gemm``, ``attn`` or ``kernel``: which host launch cost a kernel of ``op`` pays."""
    from turnip.machine.costs import cost_class

    cls = cost_class(op)
    return "gemm" if cls == "gemm" else "attn" if cls == "attention" else "kernel"


def start_latencies(mg, runs) -> list[int]:
    """Device start less host issue, ns, for every kernel whose GPU was idle when the host issued it (every
    kernel issued before it had ended), from runs recorded with start events. Attention is left out: its
    library call returns after its kernels were queued, so the issue time is late."""
    from turnip.memgraph.plan import KIND_KERNEL

    kern = np.flatnonzero(mg.kind == KIND_KERNEL)
    attn = {int(v) for v in kern if _launch_kind(mg.op[v]) == "attn"}
    out = []
    for r in runs:
        order = kern[np.argsort(r.issue_ns[kern], kind="stable")]
        busy_until = 0
        for v in order.tolist():
            iss, s0 = int(r.issue_ns[v]), int(r.start_ns[v])
            if busy_until <= iss and v not in attn:
                out.append(max(0, s0 - iss))
            busy_until = max(busy_until, int(r.end_ns[v]))
    return out


def host_samples(mg, runs, into: dict) -> dict:
    """Add the host's costs in ``runs`` (run without start events) to ``into``: issue time per launch kind
    (``gemm``, ``attn``, ``kernel``; ``copy`` for every copy), completion handling (``handle``) with the
    number of commands each completion handed back (``handle_cmds``: ``handed_back``) and, for
    kernels that ended while the host loop was only polling (issuing and handling nothing until it saw
    them), the delay from the device end to the host seeing it (``poll``); returns ``into``."""
    from turnip.memgraph.plan import KIND_KERNEL

    kinds = np.array([_launch_kind(op) if k == KIND_KERNEL else "copy" for op, k in zip(mg.op, mg.kind, strict=True)])
    kernel = mg.kind == KIND_KERNEL
    for r in runs:
        sent = r.issue_ns > 0
        issue = r.issue_ns - r.host_start_ns
        for k in ("gemm", "attn", "kernel", "copy"):
            into.setdefault(k, []).extend(issue[sent & (kinds == k)].tolist())
        for v in np.flatnonzero(sent & kernel).tolist():  # and per op
            into.setdefault("op", {}).setdefault(mg.op[v], []).append(int(issue[v]))
        into.setdefault("handle", []).extend(r.handle_ns[sent].tolist())
        into.setdefault("handle_cmds", []).extend(handed_back(r)[sent].tolist())
        # the host thread's busy intervals (issuing, handling), disjoint and in time order
        busy_s = np.concatenate([r.host_start_ns[sent], r.done_ns[sent]])
        busy_e = np.concatenate([r.issue_ns[sent], r.done_ns[sent] + r.handle_ns[sent]])
        o = np.argsort(busy_s, kind="stable")
        busy_s, busy_e = busy_s[o], np.maximum.accumulate(busy_e[o])
        k = np.flatnonzero(sent & kernel)
        nxt = np.searchsorted(busy_e, r.end_ns[k], side="right")  # first busy interval ending after the end
        idle = (nxt >= len(busy_s)) | (busy_s[np.minimum(nxt, len(busy_s) - 1)] >= r.done_ns[k])
        into.setdefault("poll", []).extend((r.done_ns - r.end_ns)[k[idle]].tolist())
        # and how many vertices were in flight then (issued, not yet seen done): the loop polls each in turn
        ends = r.end_ns[k[idle]]
        issued = np.searchsorted(np.sort(r.issue_ns[sent]), ends, side="right")
        seen = np.searchsorted(np.sort(r.done_ns[sent]), ends, side="right")
        into.setdefault("poll_inflight", []).extend((issued - seen).tolist())
    return into


def handed_back(r) -> np.ndarray:
    """Per vertex of run ``r`` (a run without launch groups, as calibration's are: one GPU, or start events):
    how many commands the host issued in answer to its completion. The host loop handles one completion, issues
    what the scheduler handed back, then handles the next: those are the vertices whose issue began after this
    completion's handling and before the next completion was seen."""
    sent = np.flatnonzero(r.issue_ns > 0)  # resident inputs complete nothing in a run
    # in the order the host handled them: two seen at once were handled the one with no handling time first
    o = sent[np.lexsort((r.handle_ns[sent], r.done_ns[sent]))]
    seen = r.done_ns[o]
    began = np.sort(r.host_start_ns[sent])
    nxt = np.append(seen[1:], np.iinfo(np.int64).max)
    n = np.searchsorted(began, nxt, side="left") - np.searchsorted(began, seen + r.handle_ns[o], side="left")
    out = np.zeros(len(r.done_ns), dtype=np.int64)
    out[o] = np.maximum(n, 0)
    return out


def run_link_gbps(mg, r) -> float:
    """The rate of a host-to-GPU link in run ``r`` (GB/s = bytes per ns): the bytes its input and reload
    copies moved over the time one of them was on its GPU's link (from its start, its issue in a run without
    start events, to its end), the busy times of every GPU's link summed; NaN when the run copied nothing from
    the host, or copied to it too (offloads share the link: its rate one way then depends on the traffic the
    other way)."""
    from analysis.metrics import _union_ns
    from turnip.machine.costs import ENG_D2H, ENG_H2D, engine_class

    e = engine_class(mg)
    h2d = (e == ENG_H2D) & (r.issue_ns > 0)
    if not h2d.any() or ((e == ENG_D2H) & (r.issue_ns > 0)).any():
        return float("nan")
    busy = 0
    for g in np.unique(mg.gpu[h2d]):
        sel = h2d & (mg.gpu == g)
        a, b = _union_ns(r.start_ns[sel], r.end_ns[sel])
        busy += int((b - a).sum())
    return float(mg.out_nbytes[h2d].sum()) / busy if busy > 0 else float("nan")


def run_issue_ns(mg, r) -> int:
    """The median time the host took to issue one kernel in run ``r``: the run's host speed."""
    from turnip.memgraph.plan import KIND_KERNEL

    k = (mg.kind == KIND_KERNEL) & (r.issue_ns > 0)
    return int(np.median((r.issue_ns - r.host_start_ns)[k])) if k.any() else 0


def host_spread(plan_runs: list[dict]) -> float:
    """The pooled within-plan standard deviation of log(per-run median issue time) over the plans' recorded
    runs (``host_run_ns``); 0 without two runs of a plan. ``host_excess_sd`` where the probe has too few
    samples (``probe_fields``): runs of one plan back to back see only seconds of the host's wander."""
    ss, dof = 0.0, 0
    for row in plan_runs:
        x = np.log([v for v in row.get("host_run_ns", []) if v > 0])
        if x.size > 1:
            ss += float(((x - x.mean()) ** 2).sum())
            dof += x.size - 1
    return float(np.sqrt(ss / dof)) if dof else 0.0


LINE_MIN_SAMPLES = 20  # line fits (`line_fit`) leave out the x values with fewer samples


def line_fit(y, x) -> tuple[int, int]:
    """(intercept, slope) of a line through the median of ``y`` at each value of ``x`` (weighted by its
    samples; values with fewer than LINE_MIN_SAMPLES left out), both >= 0; (median, 0) when fewer than two
    values qualify."""
    y, x = np.asarray(y, dtype=np.float64), np.asarray(x, dtype=np.int64)
    if y.size == 0:
        return 0, 0
    if x.size != y.size:
        return int(np.median(y)), 0
    pts = [(n, float(np.median(y[x == n])), int((x == n).sum())) for n in np.unique(x)]
    pts = [p for p in pts if p[2] >= LINE_MIN_SAMPLES]
    if len(pts) < 2:
        return int(np.median(y)), 0
    xs, ys, w = (np.array(c, dtype=np.float64) for c in zip(*pts, strict=True))
    slope, icpt = (float(c) for c in np.polyfit(xs, ys, 1, w=np.sqrt(w)))
    if slope < 0.0:  # no growth: one level, the weighted mean
        slope, icpt = 0.0, float(np.average(ys, weights=w))
    elif icpt < 0.0:  # through the origin instead of a line lifted by clipping its intercept
        slope, icpt = float((w * xs * ys).sum() / (w * xs * xs).sum()), 0.0
    return int(round(icpt)), int(round(slope))


def completion_fit(poll, inflight) -> tuple[int, int]:
    """(``completion_ns``, ``completion_per_inflight_ns``): ``line_fit`` of the poll delays in the number of
    vertices in flight."""
    return line_fit(poll, inflight)


def _med(xs) -> int:
    return int(np.median(xs)) if len(xs) else 0


def host_fields(host: dict) -> dict:
    """Profile fields from pooled host samples: launch cost per kind, completion (the poll delay on an idle
    host), handling (a line in the commands a completion hands back)."""
    comp, per = completion_fit(host.get("poll", []), host.get("poll_inflight", []))
    handle, per_cmd = line_fit(host.get("handle", []), host.get("handle_cmds", []))
    return {"gemm_launch_ns": _med(host.get("gemm", [])), "attn_launch_ns": _med(host.get("attn", [])),
            "kernel_launch_ns": _med(host.get("kernel", [])), "copy_launch_ns": _med(host.get("copy", [])),
            "completion_ns": comp, "completion_per_inflight_ns": per, "handle_ns": handle,
            "handle_per_cmd_ns": per_cmd}  # fmt: skip


def launch_rows(host: dict) -> list[dict]:
    """The profile's ``launch`` table: median issue time per kernel op."""
    return [{"op": op, "ns": _med(xs), "n": len(xs)} for op, xs in sorted(host.get("op", {}).items())]


def measure_kernels(plans: list[KernelPlan], dtype: str = "fp16", repeat: int = 3, progress=None,
                    host: dict | None = None, latency: list | None = None, run_cvs: list | None = None,
                    plan_runs: list | None = None, probe=None) -> list[dict]:  # fmt: skip
    """Kernel table rows from every plan run on one stream (``det``) with start events, each run after a rest:
    each vertex's device interval is its kernel alone at full clock. Then, without start events, the same plan
    on the default stream slots (``nondet``) back to back and on one stream: host costs (``host``), makespans
    and the idle time between runs (``plan_runs``: what the simulator's concurrency factor and power limit
    are fitted to, ``fit_gpu_effects``; the one-stream ones for reference), the run-to-run spread
    (``run_cvs``); ``latency`` gets the start latencies of the one-stream runs; ``probe`` is called after
    each plan (``HostProbe.sample``)."""
    from turnip.runtime import execute, open_loaded

    samples: dict = {}
    for i, p in enumerate(plans):
        tg, mg = plan_graph(p, dtype)
        with open_loaded("cuda", tg, mg, seed=i, device_start=True) as be:
            execute(mg, be, "det", 1, seed=0)  # warm-up: modules, handles, graphs
            runs = []
            for r in range(repeat):
                time.sleep(REST_S)
                runs.append(execute(mg, be, "det", 1, seed=r))
            be.set_device_start(False)
            serial = [execute(mg, be, "det", 1, seed=r) for r in range(repeat)]
            t_heat = time.perf_counter()  # back to back on every stream slot, as long runs go (power limit)
            while time.perf_counter() - t_heat < SUSTAIN_S:
                execute(mg, be, "nondet", 5, seed=0)
            nondet, t_run = [], []
            for r in range(repeat + 1):
                t_run.append(time.perf_counter_ns())
                if r < repeat:
                    nondet.append(execute(mg, be, "nondet", 5, seed=r))
        gaps = [t_run[r + 1] - t_run[r] - nondet[r].makespan_ns for r in range(repeat)]
        if latency is not None:
            latency.extend(start_latencies(mg, runs))
        if host is not None:
            host_samples(mg, nondet, host)
        if run_cvs is not None and len(runs) > 1:  # run-to-run spread of the whole plan
            ms = np.array([r.makespan_ns for r in nondet], dtype=np.float64)
            run_cvs.append(float(ms.std(ddof=1) / ms.mean()))
        if plan_runs is not None:  # with this plan's own host costs: how they vary with the plan
            plan_runs.append({"nondet_ms": [round(r.makespan_ns / 1e6, 4) for r in nondet],
                              "det1_ms": [round(r.makespan_ns / 1e6, 4) for r in serial],
                              "gap_ms": [round(g / 1e6, 4) for g in gaps],
                              "host": host_fields(host_samples(mg, nondet, {})),
                              "host_run_ns": [run_issue_ns(mg, r) for r in nondet]})  # fmt: skip
        _kernel_samples(mg, runs, samples)
        if probe is not None:
            probe()
        if progress:
            progress(i + 1)
    return _rows(samples)


class _Nvml:
    """Board power, its enforced limit and the SM clock through NVML (``libnvidia-ml``), or None where it
    cannot be read. The device: the first NVML device whose PCI bus id is the CUDA device's."""

    def __init__(self, pci_bus_id: str | None = None):
        import ctypes

        self.ok = False
        try:
            self.lib = lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return
            self.h = ctypes.c_void_p()
            found = pci_bus_id and lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(self.h)) == 0
            self.ok = bool(found) or lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.h)) == 0
        except OSError:
            return

    def _uint(self, fn, *args) -> int | None:
        import ctypes

        x = ctypes.c_uint()
        return int(x.value) if self.ok and fn(self.h, *args, ctypes.byref(x)) == 0 else None

    def watts(self) -> float | None:
        mw = self._uint(self.lib.nvmlDeviceGetPowerUsage) if self.ok else None
        return None if mw is None else mw / 1e3

    def limit_watts(self) -> float | None:
        mw = self._uint(self.lib.nvmlDeviceGetEnforcedPowerLimit) if self.ok else None
        return None if mw is None else mw / 1e3

    def sm_mhz(self) -> int | None:
        return self._uint(self.lib.nvmlDeviceGetClockInfo, 1) if self.ok else None  # NVML_CLOCK_SM


POWER_PLAN = KernelPlan("llama-7b", 28672, {"t": 7168, "h": 32, "f": 11008})  # the largest GEMMs and attention
POWER_LOOP_S = 2.0  # seconds of one cycle back to back: the clock settles where it holds the power limit
POWER_TAIL_S = 0.3  # the last this many seconds of a loop are timed kernel by kernel
POWER_REPEATS = 3  # rounds of every loop; each kernel's time is its median over the rounds (one round alone moved
# power_slow_attn by 8% between two calibrations of one H100 ten minutes apart)


def _sleep_kernel():
    """A one-thread kernel that sleeps about ``ns`` ns: the GPU busy on the stream but drawing idle power."""
    from cuda_kernels._numba import cuda

    c = cuda()

    @c.jit("void(int64)")
    def nap(ns):
        for _ in range(ns // 1000):
            c.nanosleep(1000)

    return nap


def measure_power(progress=None, log=print) -> dict:
    """How the GPU's clock, under its power limit, slows each class of kernel (``MachineProfile``'s
    shared-clock fields): kernels of the largest calibration plan (``POWER_PLAN``) back to back on one stream
    for ``POWER_LOOP_S``, each loop after a rest, the last ``POWER_TAIL_S`` timed kernel by kernel, NVML power
    and SM clock sampled throughout. Cycles: the largest GEMM alone (its slowdown at the clock where GEMMs
    alone hold the limit: throttle 1), attention alone, a memory-bound kernel alone (their slowdown and draw),
    two GEMMs with attention and two with memory-bound kernels (each class's slowdown at the mix's throttle,
    read off the GEMMs'), and a GEMM with a sleeping kernel of about a third and two thirds of its time
    (energy balance: the GEMM's full-clock draw). ``POWER_REPEATS`` rounds of every loop; each item's time is
    its median over the rounds (``_median_loop``), since the fields divide small differences of these times.
    Returns the raw figures (``calibration.power``) with the derived fields (``power_fields``), and the fields
    of each round alone (``repeat_fields``: their spread)."""
    import threading

    from turnip.machine.costs import cost_class, vertex_work
    from turnip.memgraph.plan import KIND_KERNEL
    from turnip.runtime import execute, open_loaded
    from turnip.sched.events import Launch

    tg, mg = plan_graph(POWER_PLAN)
    work = vertex_work(mg)
    kern = np.flatnonzero(mg.kind == KIND_KERNEL)

    def largest(pred):
        vs = [int(v) for v in kern if pred(mg.op[v])]
        return max(vs, key=lambda v: work[v]) if vs else None

    gemm = largest(lambda op: cost_class(op) == "gemm")
    attn = largest(lambda op: cost_class(op) == "attention")
    mem = largest(lambda op: op == "silu_mul") or largest(lambda op: cost_class(op) == "memory")
    nv = None
    out: dict = {"plan": POWER_PLAN.__dict__ | {"model": "llama-7b"}}
    with open_loaded("cuda", tg, mg) as be:
        execute(mg, be, "nondet", 5, seed=0)  # warm-up
        from cuda_kernels._numba import cuda

        dev = cuda().get_current_device()
        try:
            bus = f"{dev.PCI_DOMAIN_ID:08X}:{dev.PCI_BUS_ID:02X}:{dev.PCI_DEVICE_ID:02X}.0"
        except AttributeError:
            bus = None
        nv = _Nvml(bus)
        drv, h, stream = be.drv, be.hstreams[0][0], be.streams[0][0]
        nap = _sleep_kernel()

        def enqueue(item) -> None:
            if item[0] == "sleep":
                with warnings.catch_warnings():  # one thread on purpose: numba's low-occupancy warning is noise
                    warnings.simplefilter("ignore")
                    nap[1, 1, stream](item[1])
            else:
                be.submit(Launch(item[1], 0, 0))

        def timed(cycle, reps: int) -> list[list[float]]:
            """Durations (ns) of each item of ``cycle`` over ``reps`` cycles, events between every item."""
            evs = [drv.event() for _ in range(reps * len(cycle) + 1)]
            drv.check(drv.cuEventRecord(evs[0], h), "event")
            k = 0
            for _ in range(reps):
                for it in cycle:
                    enqueue(it)
                    k += 1
                    drv.check(drv.cuEventRecord(evs[k], h), "event")
            drv.check(drv.cuCtxSynchronize(), "sync")
            be._in_flight.clear()
            ns = [drv.elapsed_ms(evs[i], evs[i + 1]) * 1e6 for i in range(k)]
            for e in evs:
                drv.cuEventDestroy_v2(e)
            return [ns[i::len(cycle)] for i in range(len(cycle))]

        def rest(s: float) -> None:
            drv.check(drv.cuCtxSynchronize(), "sync")
            time.sleep(s)

        rest(0.5)
        idle = [nv.watts() for _ in range(5)] if nv.ok else []
        full = {}
        for name, v in (("gemm", gemm), ("attention", attn), ("memory", mem)):
            rest(0.3)
            full[name] = float(np.median(timed([("k", v)], 3)[0]))
        rest(0.3)
        cls_of = {gemm: "gemm", attn: "attention", mem: "memory"}
        t_g = full["gemm"]
        loops = {"gemm": [("k", gemm)], "attention": [("k", attn)], "memory": [("k", mem)],
                 "mix_attention": [("k", gemm), ("k", gemm), ("k", attn)],
                 "mix_memory": [("k", gemm), ("k", gemm), ("k", mem), ("k", mem)],
                 "sleep_short": [("k", gemm), ("sleep", int(t_g / 3))],
                 "sleep_long": [("k", gemm), ("sleep", int(2 * t_g / 3))]}  # fmt: skip
        def loop(cycle: list) -> dict:
            """One loop of ``cycle`` after a rest: its items' median times over the timed tail, NVML's median
            power and SM clock over its second half."""
            rest(0.5)
            samples: list = []
            stop = threading.Event()

            def sample(samples=samples, stop=stop) -> None:
                t0 = time.perf_counter()
                while not stop.is_set():
                    samples.append((time.perf_counter() - t0, nv.watts(), nv.sm_mhz()))
                    time.sleep(0.02)

            th = threading.Thread(target=sample, daemon=True)
            if nv.ok:
                th.start()
            one = sum(it[1] if it[0] == "sleep" else full[cls_of[it[1]]] for it in cycle)  # ns per cycle
            tail = max(1, int(POWER_TAIL_S * 1e9 / one))
            head = max(1, int((POWER_LOOP_S - POWER_TAIL_S) * 1e9 / one))
            for _ in range(head):
                for it in cycle:
                    enqueue(it)
                if len(be._in_flight) > 4096:
                    be._in_flight.clear()
            ns = timed(cycle, tail)
            stop.set()
            if nv.ok:
                th.join()
            late = [s for s in samples if s[0] >= POWER_LOOP_S / 2 and s[1] is not None]
            return {"items": [it[0] if it[0] == "sleep" else mg.op[it[1]] for it in cycle],
                    "ns": [float(np.median(x)) for x in ns],
                    "power_w": float(np.median([s[1] for s in late])) if late else None,
                    "sm_mhz": float(np.median([s[2] for s in late if s[2]])) if late else None}  # fmt: skip

        reps: list[dict] = []
        for k in range(POWER_REPEATS):  # rounds of every loop: a slow round weighs on none alone
            reps.append({})
            for i, (name, cycle) in enumerate(loops.items()):
                reps[-1][name] = loop(cycle)
                if progress:
                    progress(k * len(loops) + i + 1)
        for name in loops:
            out[name] = _median_loop([r[name] for r in reps])
    out["full_ns"] = full
    out["flops"] = {"gemm": float(mg.flops[gemm]), "attention": float(mg.flops[attn])}
    out["shapes"] = {n: "x".join(map(str, mg.shape[v])) for n, v in (("gemm", gemm), ("attention", attn),
                                                                      ("memory", mem))}  # fmt: skip
    out["limit_w"] = nv.limit_watts() if nv and nv.ok else None
    out["idle_w"] = float(np.median([w for w in idle if w])) if idle and any(idle) else None
    common = {k: out[k] for k in ("full_ns", "limit_w", "idle_w")}
    out["repeat_fields"] = [power_fields(common | r) for r in reps]  # each round alone: the fields' spread
    out |= power_fields(out)
    log(f"power: {json.dumps({k: out[k] for k in POWER_FIELDS if k in out})}; each round alone: "
        + ", ".join(f"{k} {'/'.join(str(r.get(k)) for r in out['repeat_fields'])}" for k in POWER_FIELDS))
    return out


def _median_loop(rounds: list[dict]) -> dict:
    """One loop's figures over its rounds (``measure_power``): each item's median time, the median power and
    clock; every round's times kept (``rounds_ns``)."""
    med = lambda xs: float(np.median(xs)) if xs else None  # noqa: E731
    return {"items": rounds[0]["items"], "ns": [float(x) for x in np.median([r["ns"] for r in rounds], axis=0)],
            "power_w": med([r["power_w"] for r in rounds if r["power_w"] is not None]),
            "sm_mhz": med([r["sm_mhz"] for r in rounds if r["sm_mhz"] is not None]),
            "rounds_ns": [r["ns"] for r in rounds]}  # fmt: skip


POWER_FIELDS = ("power_slow_gemm", "power_slow_attn", "power_slow_memory", "power_memory_weight",
                "power_idle_weight", "power_clock_draw")  # fmt: skip


def power_fields(pw: dict) -> dict:
    """The shared-clock fields from ``measure_power``'s figures: each class's slowdown at throttle 1 (the
    GEMM's alone; attention's and memory-bound kernels' from the mixes, scaled by the mix's throttle, read
    off its GEMMs), the memory-bound and idle draws (NVML over the limit), and ``power_clock_draw`` from the
    GEMM-with-sleep cycles' energy balance (the one whose throttle is furthest inside (0, 1); absent when
    neither is)."""
    full = pw["full_ns"]
    slow_g = max(1.0, pw["gemm"]["ns"][0] / full["gemm"])
    out = {"power_slow_gemm": round(slow_g, 4)}

    g_op = pw["gemm"]["items"][0]  # the GEMM's op in every cycle

    def theta(mix: dict) -> float:
        g = np.mean([x for it, x in zip(mix["items"], mix["ns"], strict=True) if it == g_op])
        return (g / full["gemm"] - 1.0) / (slow_g - 1.0) if slow_g > 1.001 else 0.0

    for cls, mix, item in (("attn", "mix_attention", "attention"), ("memory", "mix_memory", "memory")):
        m = pw[mix]
        th = theta(m)
        x = np.mean([t for it, t in zip(m["items"], m["ns"], strict=True) if it != g_op])
        out[f"power_slow_{cls}"] = round(float(max(1.0, 1.0 + (x / full[item] - 1.0) / th)) if th > 0.1 else 1.0, 4)
    lim = pw.get("limit_w")
    if lim and pw["memory"].get("power_w"):
        out["power_memory_weight"] = round(min(1.0, pw["memory"]["power_w"] / lim), 3)
    idle = pw.get("idle_w") / lim if lim and pw.get("idle_w") else 0.0
    out["power_idle_weight"] = round(min(idle, 0.5), 3)
    best = None
    for name in ("sleep_short", "sleep_long"):
        m = pw[name]
        th = theta(m)
        if not 0.1 < th < 0.9:
            continue
        tg, ts = m["ns"]
        p = 1.0 + (1.0 - idle) * ts / tg  # the GEMM's draw at throttle th
        f = (1.0 - th) / (p - th)  # p = (1 - th) / f + th
        if 0.2 < f <= 1.0 and (best is None or abs(th - 0.5) < best[0]):
            best = (abs(th - 0.5), f)
    if best is not None:
        out["power_clock_draw"] = round(float(best[1]), 3)
    return out


COPY_PASSES = 3  # sweeps over every copy size; each point keeps its median pass (by mean time)


def _timed_copies(drv, ev: list, stream: int, kind: str, contended: bool, n: int, issue) -> dict:
    """A copy table row: ``issue()`` (one copy of ``n`` bytes on ``stream``) timed between each event pair of
    ``ev``, back to back."""
    for e0, e1 in ev:
        drv.check(drv.cuEventRecord(e0, stream), "event")
        issue()
        drv.check(drv.cuEventRecord(e1, stream), "event")
    drv.check(drv.cuStreamSynchronize(stream), "sync")
    ns = np.array([drv.elapsed_ms(e0, e1) * 1e6 for e0, e1 in ev])
    return {"kind": kind, "contended": contended, "nbytes": int(n), "ns_mean": float(ns.mean()),
            "ns_sd": float(ns.std(ddof=1)), "n": int(ns.size)}  # fmt: skip


def _median_passes(runs: dict) -> list[dict]:
    """Each point's median pass (by mean time) of its ``passes`` sweeps."""
    return [sorted(rs, key=lambda r: r["ns_mean"])[(len(rs) - 1) // 2] for rs in runs.values()]


def measure_copies(sizes: list[int], repeat: int = 10, passes: int = COPY_PASSES) -> list[dict]:
    """H2D and D2H copies of pinned memory, alone and against a stream of copies the other way, in ``passes``
    sweeps: each point keeps its median pass (by mean time), so one sweep that something else on the host
    slowed does not set the link's speed (one sweep has measured a host link 15% slower than runs then found)."""
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

    def point(kind: str, contended: bool, n: int) -> dict:
        other = "d2h" if kind == "h2d" else "h2d"
        copy(kind, n, hm)  # warm-up
        drv.check(drv.cuStreamSynchronize(hm), "sync")
        if contended:  # keep the other direction busy for the whole measurement
            total = n * repeat * 2 + (64 << 20)
            chunk = min(big, 64 << 20)
            for _ in range(max(2, total // chunk)):
                copy(other, chunk, ho, 1)
        row = _timed_copies(drv, ev, hm, kind, contended, n, lambda: copy(kind, n, hm))
        drv.check(drv.cuStreamSynchronize(ho), "sync")
        return row

    runs: dict = {}
    try:
        for _ in range(max(1, passes)):
            for key in [(k, c, n) for k in ("h2d", "d2h") for c in (False, True) for n in sizes]:
                runs.setdefault(key, []).append(point(*key))
    finally:
        for e0, e1 in ev:
            drv.cuEventDestroy_v2(e0)
            drv.cuEventDestroy_v2(e1)
        for p in host:
            drv.cuMemFreeHost(p)
        del dev
    return _median_passes(runs)


def measure_p2p(sizes: list[int], repeat: int = 10, passes: int = COPY_PASSES) -> list[dict]:
    """Peer copies GPU 0 -> GPU 1 (``kind`` p2p) as the runtime issues them (``cuMemcpyPeerAsync`` on a stream
    of the source GPU, peer access enabled where the GPUs allow it), timed with events, in ``passes`` sweeps
    (median pass per point); [] with fewer than two GPUs."""
    from cuda_kernels._numba import cuda
    from turnip.runtime._cudadrv import PEER_ACCESS_ALREADY_ENABLED, SUCCESS, Driver

    c = cuda()
    if len(c.gpus) < 2:
        return []
    drv = Driver()
    prev = drv.current_context()  # restored at the end: peer setup leaves GPU 1's context current
    big = max(sizes)
    ctx, buf, ptr = [], [], []
    for d in (0, 1):
        with c.gpus[d]:
            ctx.append(drv.current_context())
            buf.append(c.device_array(big, dtype=np.uint8))
            ptr.append(int(buf[-1].__cuda_array_interface__["data"][0]))
    for a, b in ((0, 1), (1, 0)):
        if drv.can_access_peer(a, b):
            drv.check(drv.cuCtxSetCurrent(ctx[a]), "cuCtxSetCurrent")
            r = drv.cuCtxEnablePeerAccess(ctx[b], 0)
            if r not in (SUCCESS, PEER_ACCESS_ALREADY_ENABLED):
                drv.check(r, f"cuCtxEnablePeerAccess(gpu {a} -> gpu {b})")
    runs: dict = {}
    with c.gpus[0]:
        stream = c.stream()
        h = int(stream.handle)
        ev = [(drv.event(), drv.event()) for _ in range(repeat)]

        def copy(n: int) -> None:
            drv.check(drv.cuMemcpyPeerAsync(ptr[1], ctx[1], ptr[0], ctx[0], n, h), "cuMemcpyPeerAsync")

        try:
            for _ in range(max(1, passes)):
                for n in sizes:
                    copy(n)  # warm-up
                    runs.setdefault(n, []).append(_timed_copies(drv, ev, h, "p2p", False, n, lambda n=n: copy(n)))
        finally:
            for e0, e1 in ev:
                drv.cuEventDestroy_v2(e0)
                drv.cuEventDestroy_v2(e1)
    del buf
    if prev:
        drv.cuCtxSetCurrent(prev)
    return _median_passes(runs)


def p2p_fields(rows: list[dict]) -> dict:
    """``p2p_bytes_per_s`` (the largest peer copy's rate) and ``p2p_latency_ns`` (the smallest's time); {}
    without peer copies."""
    rows = [r for r in rows if r["kind"] == "p2p"]
    if not rows:
        return {}
    big, small = max(rows, key=lambda r: r["nbytes"]), min(rows, key=lambda r: r["nbytes"])
    return {"p2p_bytes_per_s": big["nbytes"] / big["ns_mean"] * 1e9, "p2p_latency_ns": int(small["ns_mean"])}


def streamed_plan(dtype: str = "fp16"):
    """Two decoder layers of LLaMA-7B at 3K tokens in 1 GiB, every weight copied in as the run goes (36
    copies, 0.8 GB, nothing offloaded) and 179 kernels: about 17 ms on an H100. Its taskgraph and memgraph."""
    from turnip.compile import build_with_resident, make_taskgraph

    tg = make_taskgraph("llama-7b", 3072, 1, dtype, {"t": 1024}, n_layers=2, budget_nbytes=1 << 30)
    return tg, build_with_resident(tg, 1 << 30, None, "0")


class HostProbe:
    """The host's and its host link's speed through a calibration: the streamed plan (``streamed_plan``),
    loaded once, run with ``nondet`` on the default stream slots at every ``sample()`` (one run: its kernels'
    median issue time, ``run_issue_ns``, and its link rate, ``run_link_gbps``, from the copies' device start
    events on CUDA: the link's own speed, what the simulator's link factor scales, not the host's delay in
    issuing). Sampled between the calibration's stages, so the samples span its minutes: how the host and its
    link wander between runs (``probe_fields``), where runs of one plan back to back see seconds of it.
    ``host_runs`` gives runs without start events (host costs as a plain run has them). A context manager;
    ``backend`` and ``plan`` (a (taskgraph, memgraph) pair) for tests."""

    def __init__(self, dtype: str = "fp16", backend: str = "cuda", plan=None):
        self.tg, self.mg = plan if plan is not None else streamed_plan(dtype)
        self.backend = backend
        self.samples: list[dict] = []  # {"t_s", "issue_ns", "link_gbps"}
        self._be, self._t0 = None, 0.0

    def __enter__(self) -> HostProbe:
        from turnip.runtime import execute, open_loaded

        options = {"device_start": True} if self.backend == "cuda" else {}
        self._be = open_loaded(self.backend, self.tg, self.mg, **options)
        try:
            execute(self.mg, self._be, "nondet", 5, seed=0)  # warm-up: modules, handles, graphs
        except BaseException:
            self._be.close()
            raise
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._be is not None:
            self._be.close()
            self._be = None

    def run(self, seed: int = 0, record: bool = True):
        """One run of the plan (a ``RunResult``), recorded as a sample unless ``record`` is False (runs back to
        back, which would weigh one moment of the host several times)."""
        from turnip.runtime import execute

        r = execute(self.mg, self._be, "nondet", 5, seed=seed)
        if record:
            t_s = round(time.perf_counter() - self._t0, 3)
            self.samples.append({"t_s": t_s, "issue_ns": run_issue_ns(self.mg, r),
                                 "link_gbps": round(run_link_gbps(self.mg, r), 4)})  # fmt: skip
        return r

    def sample(self) -> None:
        """One recorded run (its seed: the number of samples so far)."""
        self.run(len(self.samples))

    def host_runs(self, n: int) -> list:
        """``n`` runs back to back without start events, not samples: the issue and handling costs of a
        plain run."""
        if self.backend == "cuda":
            self._be.set_device_start(False)
        return [self.run(r, record=False) for r in range(n)]


def probe_fields(samples: list[dict]) -> dict:
    """``host_excess_sd``, ``link_excess_sd`` and ``host_link_corr`` from ``HostProbe`` samples: the standard
    deviations of log(median issue time) and of log(1 / link rate) over the samples, and the correlation of
    the two (a host that issues slowly and a link that moves bytes slowly: > 0); {} with fewer than
    PROBE_MIN_SAMPLES usable samples (the fields then stay as they are)."""
    x = np.array([(s["issue_ns"], s["link_gbps"]) for s in samples if s["issue_ns"] > 0 and s["link_gbps"] > 0],
                 dtype=np.float64).reshape(-1, 2)  # fmt: skip
    if len(x) < PROBE_MIN_SAMPLES:
        return {}
    host, link = np.log(x[:, 0]), -np.log(x[:, 1])
    sd_h, sd_l = (float(a.std(ddof=1)) if np.ptp(a) > 0 else 0.0 for a in (host, link))
    corr = float(np.corrcoef(host, link)[0, 1]) if sd_h > 0 and sd_l > 0 else 0.0
    return {"host_excess_sd": sd_h, "link_excess_sd": sd_l, "host_link_corr": float(np.clip(corr, -1.0, 1.0))}


PROBE_MIN_SAMPLES = 5


def copy_fields(copies: list[dict]) -> dict:
    """Link figures for the profile's scalar fields from the copy table: bandwidths of the largest copies,
    latency of the smallest, total of both directions at once."""
    def rate(kind, contended):
        r = max((x for x in copies if x["kind"] == kind and x["contended"] == contended), key=lambda x: x["nbytes"])
        return r["nbytes"] / r["ns_mean"] * 1e9

    small = min((x for x in copies if x["kind"] != "p2p"), key=lambda x: (x["nbytes"], x["ns_mean"]))
    return {"h2d_bytes_per_s": rate("h2d", False), "d2h_bytes_per_s": rate("d2h", False),
            "pcie_both_bytes_per_s": rate("h2d", True) + rate("d2h", True),
            "copy_latency_ns": int(small["ns_mean"])}  # fmt: skip


def host_link_totals(log=print) -> dict:
    """With several GPUs visible, the host link's totals with 1..N of them copying at once
    (``turnip.linkprobe``: the profile's ``host_*_total_bytes_per_s``); {} with one GPU or if it fails."""
    from cuda_kernels._numba import cuda

    if len(cuda().gpus) < 2:
        return {}
    from turnip.linkprobe import link_fields, measure_host_links

    try:
        return link_fields(measure_host_links(log=log))
    except Exception as e:  # noqa: BLE001 - the rest of the profile stands without it
        log(f"host link totals: the measurement failed ({type(e).__name__}: {e}); links left independent")
        return {}


def host_p2p_ports(log=print) -> dict:
    """With three or more GPUs, whether a GPU's NVLink ports are one queue each way (``turnip.linkprobe``:
    ``p2p_ports_serial``); {} with fewer or if it fails."""
    from turnip.linkprobe import measure_p2p_ports, ports_fields

    try:
        rates = measure_p2p_ports()
    except Exception as e:  # noqa: BLE001 - the rest of the profile stands without it
        log(f"GPU<->GPU ports: the measurement failed ({type(e).__name__}: {e}); left as the profile had them")
        return {}
    if rates:
        log(f"GPU<->GPU ports: one copy {rates['one'] / 1e9:.1f} GB/s, out of GPU 0 at once {rates['out'] / 1e9:.1f}, "
            f"into it {rates['into'] / 1e9:.1f}: {ports_fields(rates)}")  # fmt: skip
    return ports_fields(rates)


def calibrate(dtypes=("fp16",), quick: bool = False, progress_factory=None, log=print,
              power_loops: bool = True, p2p: bool = False, *, fit) -> dict:  # fmt: skip
    """Run every measurement; returns the profile document. ``power_loops``: measure the shared clock
    (``measure_power``) and use that model; without, the power bucket's rates are fitted alone. ``p2p``: time
    peer copies too (``measure_p2p``, two GPUs; with three or more, ``host_p2p_ports`` too). ``fit(doc,
    log=log)``: the machine fields of the GPU-wide effects fitted to the document's recorded plans
    (``sim.fit.fit_gpu_effects``, which simulates them: the caller passes it in, measuring does not import the
    simulator)."""
    t0 = time.perf_counter()
    plans = kernel_plans(quick)
    kernels: list[dict] = []
    resident: dict = {}
    latency: list = []
    run_cvs: list = []
    plan_runs: list = []
    probe = HostProbe(dtypes[0])  # loaded for the whole calibration, sampled between its stages
    with probe:
        for dt in dtypes:
            bar = progress_factory(len(plans), f"calibrate: kernels ({dt})") if progress_factory else nullcontext()
            runs_dt: list = []
            with bar:
                kernels += measure_kernels(plans, dt, repeat=2 if quick else 3, progress=getattr(bar, "update", None),
                                           host=resident, latency=latency, run_cvs=run_cvs, plan_runs=runs_dt,
                                           probe=probe.sample)  # fmt: skip
            plan_runs += [p.__dict__ | {"model": p.model.rsplit("/", 1)[-1], "dtype": dt} | r
                          for p, r in zip(plans, runs_dt, strict=True)]  # fmt: skip
        log(f"kernels: {len(kernels)} (op, shape) points from {len(plans)} plans x {len(dtypes)} dtypes, "
            f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
        sizes = [1 << k for k in range(16, 30, 1 if not quick else 2)]
        copies = measure_copies(sizes, repeat=5 if quick else 10)
        probe.sample()
        log(f"copies: {len(copies)} points, {time.perf_counter() - t0:.0f} s")
        peer: list = []
        ports: dict = {}
        if p2p:
            try:
                peer = measure_p2p([1 << k for k in range(12, 30, 1 if not quick else 2)], repeat=5 if quick else 10)
                log(f"peer copies (GPU 0 -> 1): {p2p_fields(peer) or 'none (fewer than two GPUs)'}, "
                    f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
            except Exception as e:  # noqa: BLE001 - the rest of the profile stands without it
                log(f"peer copies: the measurement failed ({type(e).__name__}: {e}); p2p fields left as they are")
            copies += peer
            ports = host_p2p_ports(log)
            probe.sample()
        links = host_link_totals(log)
        probe.sample()
        power = None
        if power_loops:
            try:
                power = measure_power(log=log)
            except Exception as e:  # noqa: BLE001 - the rest of the profile stands without it
                log(f"power: the shared-clock measurement failed ({type(e).__name__}: {e}); fitting the bucket's rates")
        probe.sample()
        log(f"power: {time.perf_counter() - t0:.0f} s")
        # the probe's last runs, back to back (not samples of the wander): the copies' issue cost and the kernels'
        # under streaming
        streamed = host_samples(probe.mg, probe.host_runs(2 if quick else 3), {})
    # kernels' issue and completion costs from the resident plans (most of a plan's kernels run so; a streamed
    # plan's kernels are hidden behind its copies anyway), copies' issue cost from the streamed plan
    host_res, host_str = host_fields(resident), host_fields(streamed)
    host = host_res | {"copy_launch_ns": host_str["copy_launch_ns"]}
    log(f"host costs: {host} (streamed plan: {host_str}), {time.perf_counter() - t0:.0f} s")
    from cuda_kernels._numba import cuda

    name = cuda().get_current_device().name
    name = name.decode() if isinstance(name, bytes) else str(name)
    start_latency = _med(latency)
    log(f"kernel start latency: {start_latency} ns (median over {len(latency)} launches on an idle GPU)")
    cv = float(np.median(run_cvs)) if run_cvs else 0.0  # a run-wide factor with this mean and spread
    gap = int(np.median([g for r in plan_runs for g in r["gap_ms"]]) * 1e6)
    log(f"runs back to back: {gap / 1e3:.0f} us idle between two")
    wander = probe_fields(probe.samples) or {"host_excess_sd": host_spread(plan_runs)}
    span = probe.samples[-1]["t_s"] if probe.samples else 0
    log(f"host and host link between runs ({len(probe.samples)} probe runs over {span:.0f} s): "
        + ", ".join(f"{k} {v:.3f}" for k, v in wander.items()))  # fmt: skip
    machine = {"name": f"calibrated {name}", "kernel_start_latency_ns": start_latency, "run_excess_mean": cv,
               "run_excess_sd": cv, "run_gap_ns": gap} | wander | host | copy_fields(copies) | \
        p2p_fields(copies) | links | ports  # fmt: skip
    doc = {"format": "turnip-profile", "version": 1, "machine": machine, "kernels": kernels, "copies": copies,
           "launch": launch_rows(resident),
           "calibration": {"device": name, "host": platform.node(), "plans": plan_runs, "dtypes": list(dtypes),
                           "host_resident": host_res, "host_streamed": host_str, "probe": probe.samples}}  # fmt: skip
    if power is not None:
        doc["calibration"]["power"] = power
        doc["machine"] |= {k: power[k] for k in POWER_FIELDS if k in power} | {"power_window_s": 0.01}
    doc["machine"] |= fit(doc, log=log)
    doc["calibration"]["seconds"] = round(time.perf_counter() - t0, 1)
    return doc


def write_profile(doc: dict, path: str) -> None:
    from turnip.fileio import atomic_write

    with atomic_write(path) as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
