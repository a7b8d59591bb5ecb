"""Per-op kernel efficiencies for the simulator from a measured kernel benchmark.

Reads the CSV of ``benchmarks/kernel_speed.py`` (device times of every op at LLaMA-7B tile sizes) and writes
``op,match,dtype,efficiency`` rows: efficiency = roofline time on the profile (max(flops / peak,
bytes / HBM bandwidth)) / measured time. Dense GEMM cases give one ``einsum,*`` row (their median); the
attention exp·V product gets its own row by subscripts. A profile uses the file through
``kernel_calibration``.

    python benchmarks/calibrate_kernels.py benchmarks/results/kernels_h100.csv turnip/machine/profiles/h100-kernels.csv
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

SUBSCRIPTS = {"attn_pv": "hqk,khd->qhd"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("measured", help="kernel_speed.py CSV")
    ap.add_argument("out", help="calibration CSV to write")
    ap.add_argument("--profile", default="h100", help="profile whose peaks define the roofline")
    a = ap.parse_args()
    from turnip.machine.profile import load_profile

    prof = load_profile(a.profile)
    d = pd.read_csv(a.measured)
    peak = np.where(d.dtype == "fp32", prof.fp32_flops_per_s, prof.fp16_flops_per_s)
    roof_s = np.maximum(d.gflop * 1e9 / peak, d.gbytes * 1e9 / prof.hbm_bytes_per_s)
    d["efficiency"] = roof_s / (d.median_us * 1e-6)
    d["match"] = [SUBSCRIPTS.get(c, "*") for c in d.case]
    rows = d.groupby(["op", "match", "dtype"], as_index=False).efficiency.median()
    rows["efficiency"] = rows.efficiency.clip(upper=1.0).round(4)
    rows.to_csv(a.out, index=False)
    print(rows.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
