"""Machine profiles: what the simulated server can do. Frozen, loadable from TOML/JSON, ``h100`` preset.

Every figure of the ``h100`` preset comes from ``shared/FACTS.md`` (one H100 80GB, measured) except those
marked "assumed" below, which nothing measured yet: change them in a profile file, not in code.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path


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
    # optional per-op efficiencies measured on the device (CSV op,match,dtype,efficiency in sim/profiles/);
    # ops it does not list keep kernel_efficiency
    kernel_calibration: str | None = None
    kernel_min_ns: int = 3_000  # assumed: smallest kernel
    # host link (PCIe), one per GPU; not fully duplex
    h2d_bytes_per_s: float = 54e9
    d2h_bytes_per_s: float = 55e9
    pcie_both_bytes_per_s: float = 84e9  # total when both directions run
    copy_latency_ns: int = 17_000  # 4 KiB host->device, p50
    # GPU<->GPU (NVLink; measured on the H200 pair)
    p2p_bytes_per_s: float = 390e9
    p2p_latency_ns: int = 10_000  # assumed
    # host driver: one thread issues every command, serially (measured on the H100 runtime with bound
    # launches replayed as CUDA graphs: benchmarks/results/prefill_h100_a.md, issue time per vertex)
    kernel_launch_ns: int = 11_000  # graph launch of a kernel + its end event, from Python
    gemm_launch_ns: int | None = 13_000  # einsum (cuBLASLt graph); None: same as kernel_launch_ns
    attn_launch_ns: int | None = 100_000  # sdpa (cuDNN's execute from Python); None: kernel_launch_ns
    copy_launch_ns: int = 13_000  # an async host<->device copy + its end event
    completion_ns: int = 7_000  # event polling and the scheduler's completion handling
    # contention (FACTS: copies slow concurrent GEMMs by ~11%)
    kernel_slowdown_with_copies: float = 1.11
    # jitter: duration = floor * (1 + e), e ~ lognormal with the given mean and standard deviation
    kernel_excess_mean: float = 0.02  # GEMM alone: p50 0.184 ms, mean 0.188 ms
    kernel_excess_sd: float = 0.02
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

    def replace(self, **kw) -> MachineProfile:
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def h100() -> MachineProfile:
    return MachineProfile()


PRESETS = {"h100": h100}
_DIR = Path(__file__).parent / "profiles"


def profile_names() -> list[str]:
    """Every name ``load_profile`` takes without a path: the presets and the profile files in ``sim/profiles/``."""
    files = {f.stem for f in [*_DIR.glob("*.toml"), *_DIR.glob("*.json")]}
    return sorted(set(PRESETS) | files)


def _check_values(p: Path, data: dict) -> None:
    """Every value of the right type (numbers for numeric fields), finite, and positive where it must be."""
    import math

    for f in dataclasses.fields(MachineProfile):
        if f.name not in data:
            continue
        v, default = data[f.name], f.default
        if isinstance(default, str) or default is None:
            ok = isinstance(v, str) or (default is None and v is None)
            if not ok:
                raise ValueError(f"{p}: field {f.name} must be a string, got {v!r}")
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{p}: field {f.name} must be a number, got {v!r}")
        if isinstance(default, int) and not isinstance(v, int):
            raise ValueError(f"{p}: field {f.name} must be a whole number, got {v!r}")
        least = 1 if f.name in ("n_gpus", "streams_per_gpu") or f.name.endswith("_per_s") else 0
        if not math.isfinite(v) or v < least or (f.name.endswith("_per_s") and v <= 0):
            raise ValueError(f"{p}: field {f.name} = {v!r} is out of range (must be {'> 0' if least else '>= 0'})")


def load_profile(name_or_path: str | Path) -> MachineProfile:
    """A preset name (``h100``), a file in ``sim/profiles/``, or a path to a .toml / .json profile.

    A file may set any subset of fields; the rest keep the ``h100`` values. Errors: ``FileNotFoundError``
    for an unknown name (listing every preset and profile file), ``ValueError`` naming the file for an
    unreadable document, unknown fields or bad values."""
    p = Path(name_or_path)
    if not p.exists() and str(name_or_path) in PRESETS:
        return PRESETS[str(name_or_path)]()
    if not p.exists():
        p = _DIR / f"{name_or_path}.toml"
    if not p.exists() or not p.is_file():
        raise FileNotFoundError(
            f"no machine profile {str(name_or_path)!r}; use one of {', '.join(profile_names())} "
            "(presets and sim/profiles/), or the path of a .toml or .json profile file"
        )
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        kind = "JSON" if p.suffix == ".json" else "TOML"
        raise ValueError(f"{p}: not a valid {kind} profile ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a profile is a table of fields, got {type(data).__name__}")
    data = data.get("machine", data)
    if not isinstance(data, dict):
        raise ValueError(f"{p}: [machine] must be a table of fields")
    known = {f.name for f in dataclasses.fields(MachineProfile)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{p}: unknown profile fields {sorted(unknown)}")
    _check_values(p, data)
    return MachineProfile(**data)


def dump_toml(profile: MachineProfile) -> str:
    lines = ["[machine]"]
    for k, v in profile.to_dict().items():
        if v is None:  # TOML has no null: an absent key loads as the default, None
            continue
        lines.append(f"{k} = {json.dumps(v)}" if isinstance(v, str) else f"{k} = {v!r}")
    return "\n".join(lines) + "\n"
