import json

import numpy as np
import pytest

from sim import simulate
from turnip.machine.profile import h100
from turnip.sched.testing import random_memgraph
from turnip.trace import MEMORY_COLUMNS, SPAN_COLUMNS

pytestmark = pytest.mark.sim


def test_trace_table_and_chrome_json(tmp_path):
    mg = random_memgraph(np.random.default_rng(0), 60, 2, p_edge=0.05)
    r = simulate(mg, h100(), "nondet", seed=0)
    tr = r.trace(mg, {"model": "random"})
    spans, mem = tr.to_frames()
    assert list(spans.columns) == list(SPAN_COLUMNS) and list(mem.columns) == list(MEMORY_COLUMNS)
    assert len(spans) == mg.n and (spans.start_ns <= spans.end_ns).all()
    assert (spans.host_start_ns <= spans.issue_ns).all() and (spans.end_ns <= spans.done_ns).all()
    tr.write_chrome(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert {"host", "gpu 0", "gpu 1", "compute", "h2d", "stream 0"} <= names
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "kernel"]
    assert len(xs) == mg.count(1) and all(e["dur"] >= 0 for e in xs)
    assert any(e["ph"] == "C" for e in doc["traceEvents"])
