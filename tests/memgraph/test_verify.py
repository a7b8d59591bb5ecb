"""The verifier catches planted faults: lost memory/data edges, cycles, out-of-bounds writes, bad reads."""

import dataclasses

import numpy as np
import pytest

from tests.memgraph.helpers import edit_deps
from turnip.memgraph.build import build_memgraph
from turnip.memgraph.plan import DEP_DATA, DEP_MEMORY, KIND_OFFLOAD, KIND_RELOAD
from turnip.memgraph.verify import verify
from turnip.models import llama_prefill, matmul_example

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def plan():
    tg = llama_prefill("tiny", seq=32, n_gpus=2, dtype="fp32")
    mg = build_memgraph(tg, 40_000)
    assert verify(mg, tg) == []
    return tg, mg


def kinds(vs):
    return {v.kind for v in vs}


def test_every_memory_edge_is_needed_somewhere(plan):
    """Dropping all memory edges into a vertex that reuses memory must be caught as a race."""
    tg, mg = plan
    targets = [v for v in range(mg.n) if (mg.dep_kind[mg.dep_ptr[v] : mg.dep_ptr[v + 1]] == DEP_MEMORY).any()]
    caught = 0
    for v in targets[:: max(1, len(targets) // 15)]:
        bad = edit_deps(mg, lambda d, v=v: d.__setitem__(v, [e for e in d[v] if e[1] != DEP_MEMORY]))
        vs = verify(bad, tg)
        caught += bool(vs)
        assert kinds(vs) <= {"race"}
    assert caught > 0


def test_missing_data_edge_caught(plan):
    tg, mg = plan
    v = next(v for v in range(mg.n) if mg.kind[v] == 1 and len(mg.reads(v)) == 2)
    bad = edit_deps(mg, lambda d: d.__setitem__(v, [e for e in d[v] if e[1] != DEP_DATA]))
    assert {"dataflow", "taskgraph"} & kinds(verify(bad, tg))


def test_cycle_caught(plan):
    tg, mg = plan
    v = next(v for v in range(mg.n) if len(mg.deps(v)))
    u = int(mg.deps(v)[0])
    bad = edit_deps(mg, lambda d: d[u].append((v, DEP_DATA)))
    vs = verify(bad, tg)
    assert kinds(vs) == {"cycle"}
    assert v in vs[0].vertices and u in vs[0].vertices


def test_out_of_bounds_caught(plan):
    tg, mg = plan
    off = mg.out_offset.copy()
    v = int(np.flatnonzero(mg.kind == 1)[-1])
    off[v] = int(mg.budget_nbytes[mg.gpu[v]]) - 8
    vs = verify(dataclasses.replace(mg, out_offset=off), tg)
    assert "bounds" in kinds(vs)


def test_overlapping_placement_caught(plan):
    """Move a buffer onto a live neighbour: a race the builder would never produce."""
    tg, mg = plan
    off = mg.out_offset.copy()
    ins = np.flatnonzero(mg.kind == 0)
    a, b = int(ins[0]), int(next(v for v in ins[1:] if mg.gpu[v] == mg.gpu[ins[0]]))
    off[b] = off[a]
    assert "race" in kinds(verify(dataclasses.replace(mg, out_offset=off), tg))


def test_lost_offload_caught():
    tg = matmul_example(256)
    mg = build_memgraph(tg, 4 * 256)
    r = int(np.flatnonzero(mg.kind == KIND_RELOAD)[0])
    o = int(np.flatnonzero(mg.kind == KIND_OFFLOAD)[0])
    bad = edit_deps(mg, lambda d: d.__setitem__(r, [e for e in d[r] if e[0] != o]))
    assert {"host", "taskgraph"} & kinds(verify(bad, tg))


def test_wrong_tensor_read_caught(plan):
    tg, mg = plan
    idx = mg.in_idx.copy()
    v = next(v for v in range(mg.n) if mg.kind[v] == 1 and len(mg.reads(v)) == 2 and mg.op[v] != "sum_into")
    a, b = mg.in_ptr[v], mg.in_ptr[v] + 1
    idx[a], idx[b] = idx[b], idx[a]
    assert "taskgraph" in kinds(verify(dataclasses.replace(mg, in_idx=idx), tg))


def _shifted_onto_a_dependency(mg, output: bool):
    """A kernel whose buffer is moved to overlap the tail of the buffer of a kernel it reads (a plan output
    when ``output``), or None."""
    outs = set(mg.outputs.tolist())
    for v in np.flatnonzero(mg.kind == 1).tolist():
        for u in mg.reads(v).tolist():
            if mg.kind[u] == 1 and mg.gpu[u] == mg.gpu[v] and (u in outs) == output and mg.op[v] != "sum_into":
                off = mg.out_offset.copy()
                off[v] = off[u] + mg.out_nbytes[u] - 4
                if off[v] + mg.out_nbytes[v] <= mg.budget_nbytes[mg.gpu[v]]:
                    return dataclasses.replace(mg, out_offset=off), u, v
    return None


def test_a_kernel_writing_over_what_it_reads_is_caught(plan):
    """A kernel's output placed over the last bytes of its own input: ordered after that input's writer (so no
    ordering race), but the kernel reads what it overwrites."""
    tg, mg = plan
    bad, u, v = _shifted_onto_a_dependency(mg, output=False)
    vs = verify(bad, tg)
    assert any(x.kind == "race" and "which it reads" in x.message and set(x.vertices) == {u, v} for x in vs)


def test_writing_over_a_plan_output_is_caught():
    """A LoRA step's new Adam moment is a plan output read after the run; the update kernel reading it, placed
    over its last bytes, is caught (a tampered plan the fuzz test found the verifier passing)."""
    from turnip.compile import compile_model
    from turnip.train import TrainSpec

    tg, mg = compile_model("llama-tiny", seq=16, dtype="fp32", n_layers=1, gpus=1, budget="2MiB",
                           train=TrainSpec(batch=1))  # fmt: skip
    assert verify(mg, tg) == []
    bad, u, v = _shifted_onto_a_dependency(mg, output=True)
    vs = verify(bad, tg)
    assert any(x.kind == "race" and "plan output" in x.message and set(x.vertices) == {u, v} for x in vs)
