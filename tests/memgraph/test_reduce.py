"""Dropping implied memory edges at emission keeps the transitive closure of the memgraph exactly; the
verifier's exact reachability agrees with a brute-force closure."""

import dataclasses
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.memgraph.helpers import edit_deps
from turnip.compile import compile_model
from turnip.memgraph import emit
from turnip.memgraph.build import BudgetError, BuildConfig, build_memgraph
from turnip.memgraph.plan import DEP_DATA, DEP_MEMORY
from turnip.memgraph.reduce import Ancestors
from turnip.memgraph.verify import _Reach, verify
from turnip.models import random_dag

STATS = {"built": 0, "offloads": 0, "dropped": 0}


def closure(n: int, deps) -> list[int]:
    """Per vertex, the bitset of its ancestors (vertices are in a topological order: deps(v) < v)."""
    anc = [0] * n
    for v in range(n):
        a = 0
        for s in deps(v):
            assert s < v
            a |= anc[s] | (1 << s)
        anc[v] = a
    return anc


def edges(mg, kind: int) -> set[tuple[int, int]]:
    dst = np.repeat(np.arange(mg.n), np.diff(mg.dep_ptr))
    sel = mg.dep_kind == kind
    return set(zip(mg.dep_src[sel].tolist(), dst[sel].tolist(), strict=True))


def check_reduction(full, red) -> None:
    """``red`` is ``full`` less some memory edges, with the same reachability."""
    assert red.n == full.n
    assert edges(red, DEP_DATA) == edges(full, DEP_DATA)
    kept, all_mem = edges(red, DEP_MEMORY), edges(full, DEP_MEMORY)
    assert kept <= all_mem
    assert red.stats["n_memory_edges"] == len(kept)
    assert red.stats["n_memory_edges_dropped"] == len(all_mem) - len(kept)
    assert full.stats["n_memory_edges_dropped"] == 0
    assert closure(red.n, lambda v: red.deps(v).tolist()) == closure(full.n, lambda v: full.deps(v).tolist())


@pytest.mark.property
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_kernels=st.integers(2, 60),
    n_gpus=st.integers(1, 3),
    max_elems=st.sampled_from([8, 64, 300]),
    budget_units=st.integers(4, 40),
    policy=st.sampled_from(["furthest", "lru", "largest"]),
    lookahead=st.sampled_from([None, None, 1, 4]),
    window=st.sampled_from([None, 0, 1, 3, 8, 20]),
)
def test_random_plans_keep_closure(seed, n_kernels, n_gpus, max_elems, budget_units, policy, lookahead, window):
    """Small budgets force offload/reload and memory reuse; small ancestor windows exercise the frames."""
    tg = random_dag(np.random.default_rng(seed), n_kernels=n_kernels, n_gpus=n_gpus, max_elems=max_elems)
    budget = budget_units * max(256, max_elems * 4)
    try:
        cfg = BuildConfig(policy=policy, lookahead_vertices=lookahead)
        full = build_memgraph(tg, budget, dataclasses.replace(cfg, reduce_memory_edges=False))
    except BudgetError:
        return
    win = emit.ancestor_window if window is None else (lambda g: window)
    with mock.patch.object(emit, "ancestor_window", win):
        red = build_memgraph(tg, budget, cfg)
    check_reduction(full, red)
    assert verify(red, tg) == []
    STATS["built"] += 1
    STATS["offloads"] += red.stats["n_offload"] > 0
    STATS["dropped"] += red.stats["n_memory_edges_dropped"] > 0


@pytest.mark.property
def test_random_plans_exercised_reduction():
    """Guard against a vacuous run: most examples built, many offloaded and many dropped edges."""
    if STATS["built"] == 0:
        pytest.skip("runs only after the property test in the same session")
    assert STATS["built"] >= 100 and STATS["offloads"] >= 20 and STATS["dropped"] >= 20, STATS


@pytest.mark.property
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 120),
    window=st.integers(0, 40),
    frame=st.integers(1, 12),
)
def test_ancestors_on_random_dags(seed, n, window, frame):
    """Any DAG in topological order, any window and frame: only implied memory edges go."""
    rng = np.random.default_rng(seed)
    anc = Ancestors(window=window, frame=frame)
    full, kept = [], []
    for v in range(n):
        k = int(rng.integers(0, min(v, 6) + 1))
        srcs = rng.choice(v, size=k, replace=False).tolist() if k else []
        deps = {int(s): int(rng.choice([DEP_DATA, DEP_MEMORY])) for s in srcs}
        full.append(dict(deps))
        s, kinds = anc.add(deps)
        kept.append(dict(zip(s, kinds, strict=True)))
        assert set(kept[v]) <= set(full[v])
        assert all(full[v][u] == DEP_MEMORY for u in set(full[v]) - set(kept[v]))
        assert all(kept[v][u] == full[v][u] for u in kept[v])
    assert anc.n_dropped == sum(len(f) - len(k) for f, k in zip(full, kept, strict=True))
    assert closure(n, lambda v: list(kept[v])) == closure(n, lambda v: list(full[v]))
    if window >= n:  # everything inside the window: the reduction is the transitive reduction
        anc_all = closure(n, lambda v: list(full[v]))
        for v in range(n):
            others = 0
            for w in kept[v]:
                others |= anc_all[w]
            assert not any((others >> u) & 1 for u in kept[v] if kept[v][u] == DEP_MEMORY)


@pytest.mark.property
@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 80), chunk=st.integers(1, 9))
def test_verifier_reach_matches_closure(seed, n, chunk):
    """The verifier's reachability (quick checks, then exact batched bitsets) on a random DAG, given to it
    in a shuffled vertex order, against a brute-force closure."""
    rng = np.random.default_rng(seed)
    deps = [sorted({int(s) for s in rng.integers(0, v, size=int(rng.integers(0, 3)))}) if v else [] for v in range(n)]
    perm = rng.permutation(n)  # vertex v is called perm[v]; the topological index is v
    preds = [np.zeros(0, dtype=np.int64)] * n
    for v in range(n):
        preds[perm[v]] = perm[deps[v]]
    graph = SimpleNamespace(n=n, deps=lambda v: preds[v])
    reach = _Reach(graph, np.argsort(perm), chunk=chunk)
    anc = closure(n, lambda v: deps[v])
    failed: set[tuple[int, int]] = set()
    for a in range(n):
        for b in range(n):
            reach.require(int(perm[a]), int(perm[b]), lambda a, b: failed.add((a, b)), a, b)
    reach.resolve()
    expect = {(a, b) for a in range(n) for b in range(n) if a != b and not (anc[b] >> a) & 1}
    assert failed == expect


@pytest.mark.unit
def test_llama_7b_4k_1gib_drops_most_memory_edges():
    tg, mg = compile_model("llama-7b", seq=4096, gpus=1, budget="1GiB")
    _, full = compile_model("llama-7b", seq=4096, gpus=1, budget="1GiB", config=BuildConfig(reduce_memory_edges=False))
    kept, dropped = mg.stats["n_memory_edges"], mg.stats["n_memory_edges_dropped"]
    print(f"7B/4K/1GiB: {kept + dropped} memory edges emitted, {dropped} dropped, {kept} kept")
    assert kept + dropped == full.stats["n_memory_edges"]
    assert dropped > 0.5 * (kept + dropped)
    check_reduction(full, mg)
    assert verify(mg, tg) == []


@pytest.mark.unit
@pytest.mark.parametrize("model,gpus,budget", [("llama-tiny", 2, 40_000), ("llama-7b", 1, "1GiB")])
def test_every_kept_memory_edge_is_needed(model, gpus, budget):
    """A kept memory edge is implied by no other path, so the verifier must report a race without it."""
    kw = {"seq": 32, "dtype": "fp32"} if model == "llama-tiny" else {"seq": 4096}
    tg, mg = compile_model(model, gpus=gpus, budget=budget, **kw)
    mem = sorted(edges(mg, DEP_MEMORY))
    assert mem
    for u, v in mem[:: max(1, len(mem) // 12)]:
        bad = edit_deps(mg, lambda d, u=u, v=v: d.__setitem__(v, [e for e in d[v] if e[0] != u]))
        vs = verify(bad, tg)
        assert {x.kind for x in vs} == {"race"} and any(x.vertices == (u, v) for x in vs), (u, v, vs[:3])
