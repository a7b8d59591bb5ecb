"""Machine profiles: what a server can do. Frozen, loadable from TOML/JSON, ``h100`` preset.

A profile describes a plan's machine for both clocks: the simulator (``sim``) and the real runtime's lower
bound read it, so it lives outside ``sim``. Scalar fields are roofline, link, host and jitter figures; a
JSON profile may also carry measured tables (``kernels``, ``copies``: ``turnip.machine.tables``) that
replace the roofline x efficiency model for the vertices they cover. The file format is ``docs/profile.md``.

Every figure of the ``h100`` preset comes from ``shared/FACTS.md`` (one H100 80GB, measured) except those
marked "assumed" below, which nothing measured yet, and the ``peak_*`` datasheet figures: change them in a
profile file, not in code. ``host_*_total_bytes_per_s`` (tuples: the host behind the GPUs' links, total rate
by the number of GPUs copying at once) are () by default, every link on its own; the preset carries the
four-H100 host's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from turnip.machine.tables import CostTables, parse_tables


@dataclass(frozen=True, slots=True)
class MachineProfile:
    name: str = "h100"
    n_gpus: int = 8  # GPUs in the server (a plan may use fewer)
    streams_per_gpu: int = 5  # the paper's engine
    # kernels: roofline x efficiency; one kernel engine per GPU (big kernels run one at a time)
    fp16_flops_per_s: float = 740e12  # cuBLAS 8192^3
    fp32_flops_per_s: float = 52e12
    hbm_bytes_per_s: float = 2.9e12  # device copy, bytes read + written
    kernel_efficiency: float = 0.8  # assumed: tiles reach 80% of the 8192^3 roofline
    # optional per-op efficiencies measured on the device (CSV op,match,dtype,efficiency in
    # turnip/machine/profiles/); ops it does not list keep kernel_efficiency
    kernel_calibration: str | None = None
    kernel_min_ns: int = 3_000  # assumed: smallest kernel
    # datasheet peaks (H100 SXM, dense): no kernel beats them; the lower bound (``turnip.machine.bound``) uses
    # them where the model's floors above (measured or roofline x efficiency) could be beaten
    peak_fp16_flops_per_s: float = 989.4e12  # fp16 and bf16
    peak_fp32_flops_per_s: float = 67e12
    peak_hbm_bytes_per_s: float = 3.35e12
    # host link (PCIe), one per GPU; not fully duplex
    h2d_bytes_per_s: float = 54e9
    d2h_bytes_per_s: float = 55e9
    pcie_both_bytes_per_s: float = 84e9  # total when both directions run
    copy_latency_ns: int = 17_000  # 4 KiB host->device, p50
    # the host behind the links: entry i is the total rate over all GPUs when i + 1 GPUs copy at once (host to
    # GPU, GPU to host, both directions); the last entry holds beyond the end. Applied when 2 or more GPUs copy
    # (one GPU's copies follow its own link's fields above; the first entry is informational). (): every GPU's
    # link independent of the others. The h100 preset carries the four-H100 host's (FACTS.md, 2026-11-26)
    host_h2d_total_bytes_per_s: tuple[float, ...] = ()
    host_d2h_total_bytes_per_s: tuple[float, ...] = ()
    host_both_total_bytes_per_s: tuple[float, ...] = ()
    # GPU<->GPU (NVLink; measured on the H200 pair)
    p2p_bytes_per_s: float = 390e9
    p2p_latency_ns: int = 10_000  # assumed
    # True: a GPU sends one GPU<->GPU copy at a time and takes one at a time (its NVLink ports as one queue out
    # and one in, in issue order; on four H100s three 32 MiB copies issued together out of one GPU ended 92 us
    # apart, each at the one-copy rate). False: every pair's copies independent of the others
    p2p_ports_serial: bool = False
    # host driver: one thread issues every command, serially (measured on the H100 runtime with bound
    # launches replayed as CUDA graphs: benchmarks/results/prefill_h100_a.md, issue time per vertex)
    kernel_launch_ns: int = 11_000  # graph launch of a kernel + its end event, from Python
    gemm_launch_ns: int | None = 13_000  # einsum (cuBLASLt graph); None: same as kernel_launch_ns
    attn_launch_ns: int | None = 100_000  # sdpa (cuDNN's execute from Python); None: kernel_launch_ns
    copy_launch_ns: int = 13_000  # an async host<->device copy + its end event
    # a launch group's graph (turnip.sched.groups) costs its head's launch plus this much per other member (its
    # kernel node and end-event node; measured on an H200 quad: 7B 4K, 3.5 ms of issue per run for 81 launches of
    # 9.5 kernels each on one GPU, 12.0 ms for about 900 launches of 2,500 vertices on four)
    group_member_launch_ns: int = 3_000
    # a kernel's launch (or a launch group's) issued right after a command for another GPU costs this much more
    # (the driver switches context; measured on four H100s: 11.4 us a kernel after a switch, 8.4 us after one
    # for the same GPU, median over a 7B 4K prompt's 1,729 kernel commands)
    gpu_switch_launch_ns: int = 0
    # the same where a group records only its last member's end event (``turnip.sched.groups.group_events_on``:
    # training steps); 0: group_member_launch_ns
    group_member_noevent_launch_ns: int = 0
    completion_ns: int = 7_000  # a completion event reaching the host loop (polling), host idle
    # and this much more per vertex in flight: the loop queries every in-flight vertex's end event in turn
    # (`turnip calibrate` fits both to the poll delays it sees; 0: a constant delay)
    completion_per_inflight_ns: int = 0
    handle_ns: int = 0  # the host's time to handle a completion (scheduler); the host issues nothing meanwhile
    # and this much more per command the completion hands back to issue (the scheduler picks a stream and builds
    # each one: a copy's completion that frees the link and readies its consumer returns two); `turnip
    # calibrate` fits both to the handling times it sees (0: every completion costs handle_ns)
    handle_per_cmd_ns: int = 0
    # a kernel starts on the device this long after the host issues it, when its GPU is idle (driver
    # launch latency and the delay until the host sees its dependencies' completion events; measured by
    # `turnip calibrate`, 0 in the presets)
    kernel_start_latency_ns: int = 0
    # concurrency: a kernel that starts behind another on its GPU (the host issued it while the GPU was busy)
    # shares the GPU with it; on the simulator's one kernel engine it then takes this factor of its floor,
    # log-linear in the floor between OVERLAP_SHORT_NS (kernel_overlap_short) and OVERLAP_LONG_NS
    # (kernel_overlap_long), constant beyond (small kernels overlap, big ones contend). Fitted by
    # `turnip calibrate` to the makespans of its plans on every stream slot; 1.0 in the presets
    kernel_overlap_short: float = 1.0
    kernel_overlap_long: float = 1.0
    # power limit: under sustained load a GPU reaches its power limit and lowers its clocks (an H100 at 700 W:
    # SM clock 1980 -> 1300-1620 MHz in long prefills). Modelled as a token bucket per GPU: tokens (ns at the
    # limit) accrue one per ns up to power_burst_s x 1e9, and a kernel running at full clock spends w per ns,
    # w its power over the limit's: a GEMM's flop rate over power_gemm_flops_rate (the rate the GPU
    # sustains at the limit), attention's over power_attn_flops_rate, power_memory_weight for memory-bound
    # kernels. Once the bucket is empty a kernel with w > 1 runs w times longer (at the sustained rate).
    # 0: no limit for that class. A run starts in the bucket's steady state for runs back to back with
    # run_gap_ns of idle between them (``sim.engine.simulate``). `turnip calibrate` measures kernels at full
    # clock (after a rest) and fits the two rates to its plans run back to back; the burst and the memory
    # weight are assumed. power_duty < 1 instead: the older uniform model (every kernel's w = 1 / power_duty)
    power_gemm_flops_rate: float = 0.0
    power_attn_flops_rate: float = 0.0
    power_memory_weight: float = 0.5
    power_duty: float = 1.0
    power_burst_s: float = 0.05
    # shared clock (on when power_slow_gemm > 0; the rates above keep their meaning): the clock is the GPU's,
    # not a kernel's. The bucket (refilled 1 - power_idle_weight per ns: an idle GPU draws that much of the
    # limit) may go into debt; the GPU then runs at throttle theta = debt / (power_window_s x 1e9) (0 while the
    # bucket holds energy, at most THETA_MAX), theta 1 being the clock at which its largest GEMMs alone hold the
    # limit. Every kernel then takes 1 + theta x (power_slow_<class> - 1) times its full-clock time (GEMMs,
    # attention, memory-bound kernels: how much each class slows at that clock) and draws its full-clock power
    # times 1 - theta x (1 - power_clock_draw) (memory-bound kernels: power_memory_weight at any clock).
    # `turnip calibrate` measures the slowdowns, the draws of attention, memory-bound kernels and the idle GPU
    # (kernels back to back on one stream, NVML power readings) and fits power_clock_draw (power_gemm_flops_rate
    # = power_clock_draw x the best GEMM rate: those GEMMs draw 1 / power_clock_draw of the limit at full clock)
    power_slow_gemm: float = 0.0
    power_slow_attn: float = 1.0
    power_slow_memory: float = 1.0
    power_clock_draw: float = 1.0
    power_idle_weight: float = 0.0
    power_window_s: float = 0.01
    run_gap_ns: int = 0  # the host's idle time between two runs back to back (calibrate measures it)
    # contention (FACTS: copies slow concurrent GEMMs by ~11%)
    kernel_slowdown_with_copies: float = 1.11
    # while a GPU<->GPU copy in or out of its GPU runs (0: as with any copy, the field above)
    kernel_slowdown_with_p2p: float = 0.0
    # that slowdown by kernel: 1 + (slowdown - 1) x the share of the kernel's roofline time that is memory traffic
    # (a GEMM or attention bound by its flops barely slowed, an elementwise kernel fully); false: every kernel alike
    p2p_slowdown_memory_share: bool = False
    # jitter: duration = floor * (1 + e), e ~ lognormal with the given mean and standard deviation (the sd of
    # a vertex a measured table covers comes from the table instead)
    kernel_excess_mean: float = 0.02  # GEMM alone: p50 0.184 ms, mean 0.188 ms
    kernel_excess_sd: float = 0.02
    # run-wide: one draw per run scales every kernel of it (clocks and power state are shared by a run;
    # per-vertex jitter averages out over thousands of vertices, this does not). `turnip calibrate` measures
    # it as the spread of repeated runs' makespans; 0 in the presets
    run_excess_mean: float = 0.0
    run_excess_sd: float = 0.0
    # host speed: one draw per run scales every host cost of it (issue, handling, completion) by
    # exp(host_excess_sd x z), median 1: the host CPU's speed changes between runs (on a lent H100 the
    # median GEMM issue time of a 1K prefill was 6.2-8.8 us in three nondet runs back to back, 7.0-10.5 us in
    # three det runs). `turnip calibrate` measures it as the spread of a probe plan's per-run median issue
    # times over the calibration's minutes (`calibrate.HostProbe`); 0 in the presets
    host_excess_sd: float = 0.0
    # host link speed: one draw per run scales the time every copy between host and GPU takes to push its bytes
    # by exp(link_excess_sd x z'), median 1, with z' correlated host_link_corr with the host's z (on noisy
    # machines the host and its link slow down together). `turnip calibrate` measures both from a streamed
    # probe plan run between its stages; 0 in the presets
    link_excess_sd: float = 0.0
    host_link_corr: float = 0.0
    kernel_contended_excess_mean: float = 0.02
    kernel_contended_excess_sd: float = 0.073  # GEMM with a copy stream: cv 7.3%
    h2d_excess_mean: float = 0.005
    h2d_excess_sd: float = 0.008  # alone: cv 0.8%
    h2d_contended_excess_mean: float = 0.02
    h2d_contended_excess_sd: float = 0.14  # with the other direction: cv 14%, p99 1.6x mean
    d2h_excess_mean: float = 0.005
    d2h_excess_sd: float = 0.014
    d2h_contended_excess_mean: float = 0.02
    d2h_contended_excess_sd: float = 0.076
    p2p_excess_mean: float = 0.01  # assumed
    p2p_excess_sd: float = 0.02  # assumed
    # rare copy stalls: with this probability a copy waits an extra Pareto(alpha) * scale
    stall_prob: float = 0.002  # assumed
    stall_scale_ns: int = 100_000  # assumed
    stall_alpha: float = 2.0  # assumed
    # measured kernel and copy tables (a profile document's "kernels" and "copies"; None: the roofline and
    # the constants above). For a vertex a table covers, the mean comes from the table, the floor is that
    # mean / (1 + the excess mean above) and the excess sd is the table's cv x (1 + excess mean).
    tables: CostTables | None = field(default=None, repr=False)

    def replace(self, **kw) -> MachineProfile:
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        """The scalar fields (``tables`` left out: ``dump_json`` writes them)."""
        return {f.name: getattr(self, f.name) for f in _SCALARS}


_SCALARS = tuple(f for f in dataclasses.fields(MachineProfile) if f.name != "tables")


# the host link shared by four H100s (pinned copies, one stream per GPU, all at once; FACTS.md, 2026-11-26)
H100_HOST_H2D = (54.8e9, 104.0e9, 145.5e9, 159.2e9)
H100_HOST_D2H = (54.8e9, 106.7e9, 122.3e9, 123.9e9)
H100_HOST_BOTH = (54.6e9, 108.6e9, 131.1e9, 138.1e9)
HOST_TOTALS = ("host_h2d_total_bytes_per_s", "host_d2h_total_bytes_per_s", "host_both_total_bytes_per_s")


def h100() -> MachineProfile:
    """The ``h100`` preset: the class defaults with the measured four-H100 host (``H100_HOST_*``)."""
    return MachineProfile(host_h2d_total_bytes_per_s=H100_HOST_H2D, host_d2h_total_bytes_per_s=H100_HOST_D2H,
                          host_both_total_bytes_per_s=H100_HOST_BOTH)  # fmt: skip


def host_total_bytes_per_s(table: tuple[float, ...], n: int) -> float | None:
    """The total rate of ``table`` (a ``host_*_total_bytes_per_s`` field) with ``n`` GPUs copying at once: its
    entry n - 1, its last beyond its end; None for n < 2 or an empty table (no cap: each GPU's own link)."""
    if n < 2 or not table:
        return None
    return table[min(n, len(table)) - 1]


PRESETS = {"h100": h100}
_DIR = Path(__file__).parent / "profiles"
DOC_KEYS = ("format", "version", "machine", "kernels", "copies", "launch")
INFO_KEYS = ("calibration",)  # informational top-level keys a profile document may carry


def profile_names() -> list[str]:
    """Every name ``load_profile`` takes without a path: the presets and the profile files in
    ``turnip/machine/profiles/``."""
    files = {f.stem for f in [*_DIR.glob("*.toml"), *_DIR.glob("*.json")]}
    return sorted(set(PRESETS) | files)


def _check_values(p: Path, data: dict) -> None:
    """Every value of the right type (numbers for numeric fields), finite, and positive where it must be."""
    for f in _SCALARS:
        if f.name not in data:
            continue
        v, default = data[f.name], f.default
        if isinstance(default, tuple):
            ok = isinstance(v, list | tuple) and all(not isinstance(x, bool) and isinstance(x, int | float) for x in v)
            if not ok or not all(math.isfinite(x) and x > 0 for x in v):
                raise ValueError(f"{p}: field {f.name} = {v!r} must be a list of finite numbers > 0 (total bytes "
                                 "per second with 1, 2, ... GPUs copying at once)")  # fmt: skip
            continue
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise ValueError(f"{p}: field {f.name} must be true or false, got {v!r}")
            continue
        if isinstance(default, str) or default is None:
            ok = isinstance(v, str) or (default is None and v is None)
            if not ok:
                raise ValueError(f"{p}: field {f.name} must be a string, got {v!r}")
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{p}: field {f.name} must be a number, got {v!r}")
        if isinstance(default, int) and not isinstance(v, int):
            raise ValueError(f"{p}: field {f.name} must be a whole number, got {v!r}")
        if f.name == "host_link_corr":
            if not -1 <= v <= 1:
                raise ValueError(f"{p}: field host_link_corr = {v!r} is out of range (a correlation: -1 to 1)")
            continue
        least = 1 if f.name in ("n_gpus", "streams_per_gpu") or f.name.endswith("_per_s") else 0
        if not math.isfinite(v) or v < least or (f.name.endswith("_per_s") and v <= 0):
            raise ValueError(f"{p}: field {f.name} = {v!r} is out of range (must be {'> 0' if least else '>= 0'})")
    duty = data.get("power_duty", 1.0)
    if not 0 < duty <= 1:
        raise ValueError(f"{p}: field power_duty = {duty!r} is out of range (must be > 0 and <= 1)")
    if not 0 < data.get("power_clock_draw", 1.0) <= 1 or data.get("power_idle_weight", 0.0) >= 1:
        raise ValueError(f"{p}: power_clock_draw must be > 0 and <= 1 and power_idle_weight < 1 (got "
                         f"{data.get('power_clock_draw', 1.0)!r}, {data.get('power_idle_weight', 0.0)!r})")  # fmt: skip
    slow = data.get("power_slow_gemm", 0.0)
    if slow and (slow < 1 or data.get("power_window_s", 0.01) <= 0 or duty < 1):
        raise ValueError(f"{p}: power_slow_gemm = {slow!r} (the shared-clock model) needs power_slow_gemm >= 1, "
                         "power_window_s > 0 and no power_duty")  # fmt: skip
    for f in ("power_slow_attn", "power_slow_memory"):
        if data.get(f, 1.0) < 1:
            raise ValueError(f"{p}: field {f} = {data[f]!r} is out of range (a slowdown: must be >= 1)")
    rates = [f for f in ("power_gemm_flops_rate", "power_attn_flops_rate") if data.get(f, 0) > 0]
    if duty < 1 and rates:
        raise ValueError(f"{p}: power_duty = {duty!r} (the uniform power model) and {', '.join(rates)} (the "
                         "flop-rate model) both set: keep one")  # fmt: skip


def _find(name_or_path: str | Path) -> Path | None:
    p = Path(name_or_path)
    if p.exists():
        return p if p.is_file() else None
    for suffix in (".toml", ".json"):
        q = _DIR / f"{name_or_path}{suffix}"
        if q.is_file():
            return q
    return None


def profile_for_gpu(name: str) -> str:
    """The shipped profile of a GPU by its name (as the driver gives it, e.g. "NVIDIA H200"): ``h200-calibrated``
    for an H200, ``h100-calibrated`` for an H100, else the ``h100`` preset."""
    n = name.upper()
    if "H200" in n:
        return "h200-calibrated"
    if "H100" in n:
        return "h100-calibrated"
    return "h100"


def load_profile(name_or_path: str | Path) -> MachineProfile:
    """A preset name (``h100``), a file in ``turnip/machine/profiles/`` (by stem), or a path to a .toml /
    .json profile.

    A file may set any subset of scalar fields; the rest keep the ``h100`` values. A document with
    ``format``/``version``/``machine``/``kernels``/``copies`` keys is a full profile (``docs/profile.md``);
    otherwise the file is the table of scalar fields itself. Errors: ``FileNotFoundError`` for an unknown
    name (listing every preset and profile file), one-line ``ValueError`` naming the file for an unreadable
    document, unknown fields, bad values or a bad table row."""
    if not Path(name_or_path).exists() and str(name_or_path) in PRESETS:
        return PRESETS[str(name_or_path)]()
    p = _find(name_or_path)
    if p is None:
        raise FileNotFoundError(
            f"no machine profile {str(name_or_path)!r}; use one of {', '.join(profile_names())} "
            "(presets and turnip/machine/profiles/), or the path of a .toml or .json profile file"
        )
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        kind = "JSON" if p.suffix == ".json" else "TOML"
        raise ValueError(f"{p}: not a valid {kind} profile ({_one_line(e)})") from e
    return profile_from_data(data, p)


def profile_from_data(data, p: str | Path = "<profile>") -> MachineProfile:
    """The profile of a parsed TOML/JSON document or table of fields (``load_profile``'s checks and errors;
    ``p`` names the source in them)."""
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a profile is a table of fields, got {type(data).__name__}")
    machine, tables = data, None
    if any(k in data for k in DOC_KEYS):
        extra = sorted(set(data) - set(DOC_KEYS) - set(INFO_KEYS))
        if extra:
            raise ValueError(f"{p}: unknown top-level keys {extra} (a profile document has {', '.join(DOC_KEYS)})")
        if data.get("format", "turnip-profile") != "turnip-profile":
            raise ValueError(f"{p}: format is {data['format']!r}, not 'turnip-profile'")
        if data.get("version", 1) != 1:
            raise ValueError(f"{p}: profile version {data['version']!r} is not supported (this turnip reads 1)")
        machine = data.get("machine", {})
        tables = parse_tables(str(p), data.get("kernels"), data.get("copies"), data.get("launch"))
    if not isinstance(machine, dict):
        raise ValueError(f"{p}: machine must be a table of fields")
    unknown = set(machine) - {f.name for f in _SCALARS}
    if unknown:
        raise ValueError(f"{p}: unknown profile fields {sorted(unknown)}")
    _check_values(p, machine)
    machine = {k: tuple(float(x) for x in v) if k in HOST_TOTALS else v for k, v in machine.items()}
    return MachineProfile(**machine, tables=tables)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def dump_toml(profile: MachineProfile) -> str:
    """The scalar fields as a TOML profile; a profile with tables needs ``dump_json``."""
    if profile.tables is not None:
        raise ValueError(f"profile {profile.name!r} has measured tables, which TOML profiles do not carry; "
                         "use dump_json")  # fmt: skip
    lines = ["[machine]"]
    for k, v in profile.to_dict().items():
        if v is None:  # TOML has no null: an absent key loads as the default, None
            continue
        if isinstance(v, tuple):
            lines.append(f"{k} = [{', '.join(repr(x) for x in v)}]")
        else:
            lines.append(f"{k} = {json.dumps(v)}" if isinstance(v, str | bool) else f"{k} = {v!r}")
    return "\n".join(lines) + "\n"


def dump_json(profile: MachineProfile) -> str:
    """The whole profile, tables included, as a ``turnip-profile`` JSON document."""
    doc: dict = {"format": "turnip-profile", "version": 1, "machine": profile.to_dict()}
    if profile.tables is not None:
        doc["kernels"], doc["copies"], launch = profile.tables.to_rows()
        if launch:
            doc["launch"] = launch
    return json.dumps(doc, indent=1) + "\n"
