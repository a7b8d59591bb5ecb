"""``benchmarks/dispatch.py``: the launch-group cost fit, and the script end to end on the CPU backend."""

import csv
from types import SimpleNamespace

import numpy as np
import pytest

from tests.benchscripts import load_script
from turnip.calibrate import LINE_MIN_SAMPLES

pytestmark = pytest.mark.unit


def test_group_fit_recovers_a_head_and_member_cost():
    dispatch = load_script("dispatch")
    members, n = {}, 0
    for extra in (1, 2, 3, 5):  # LINE_MIN_SAMPLES groups of each size
        for _ in range(LINE_MIN_SAMPLES):
            members[n] = list(range(n, n + extra + 1))
            n += extra + 1
    start = np.zeros(n, dtype=np.int64)
    issue = np.zeros(n, dtype=np.int64)
    for h, m in members.items():
        issue[h] = 8_000 + 6_000 * (len(m) - 1)  # 8 µs a head, 6 µs a member
    runs = [SimpleNamespace(issue_ns=issue, host_start_ns=start)] * 2
    head, member = dispatch.group_fit(runs, SimpleNamespace(members=members))
    assert head == pytest.approx(8.0) and member == pytest.approx(6.0)
    assert all(np.isnan(x) for x in dispatch.group_fit(runs, None))


def test_script_runs_on_the_cpu_backend(tmp_path):
    dispatch = load_script("dispatch")
    assert dispatch.main(["--model", "llama-tiny", "--backend", "cpu", "--rows", "32:1MiB:2", "--variants", "groups",
                          "--policies", "nondet", "--repeat", "1", "--out", str(tmp_path)]) == 0  # fmt: skip
    (row,) = list(csv.DictReader(open(tmp_path / "dispatch.csv")))
    assert row["equal_to_first"] == "True" and float(row["group_head_us"]) > 0 and float(row["group_member_us"]) >= 0
