"""The importer's records, fusion, automatic tiling and new ops without PyTorch (numpy only): a hand-built
record graph (contractions, GELU, an RMSNorm chain, layer norm, softmax, a reduction, a transpose, a slice, a
concatenation, bidirectional attention) fused, tiled under a budget that offloads, lowered, planned, verified
and run on the CPU backend against numpy."""

import numpy as np
import pytest

from turnip.torchimport.ir import IR, choose_tiles, emit, lower_imported
from turnip.torchimport.patterns import fuse, live

pytestmark = pytest.mark.cpu_runtime
T, D, F, H, E = 24, 16, 40, 2, 8


def ew(ir, fn, xs, out, axes=None, **p):
    """An ew record; each operand's axes trail the output's unless ``axes`` says otherwise."""
    n = len(out)
    axes = axes or [list(range(n - len(ir.recs[x].dims), n)) for x in xs]
    return ir.add("ew", xs, out, {"fn": fn, "n": n, "axes": axes, **p})


def like(ir, r):
    return [ir.like(d) for d in ir.recs[r].dims]


def build(rng):
    ir = IR(dtype="fp32")
    t, d = ir.dim(T), ir.dim(D)
    x = ir.add("input", [], [t, d], name="x")
    vals = {"x": rng.standard_normal((T, D)).astype(np.float32)}

    def const(name, *dims):
        vals[name] = rng.standard_normal([ir.ext[e] for e in dims]).astype(np.float32) * 0.3
        return ir.add("input", [], list(dims), name=name, value=vals[name])

    f, dw = ir.dim(F), ir.like(d)
    w1 = const("w1", f, dw)
    h = ir.add("einsum", [x, w1], [ir.like(t), ir.like(f)], {"idx": [[0, 1], [2, 1]], "out": [0, 2]})
    g = ew(ir, "gelu", [h], like(ir, h))
    w2 = const("w2", ir.like(d), ir.like(f))
    y = ir.add("einsum", [g, w2], [ir.like(t), ir.like(d)], {"idx": [[0, 1], [2, 1]], "out": [0, 2]})
    y = ew(ir, "add", [x, y], like(ir, y))  # the residual: becomes add_n
    ir.join(ir.recs[y].dims[0], t)
    # RMSNorm as a program writes it: pow, mean, + eps, rsqrt, x * r, w * (x * r)
    p2 = ew(ir, "pow", [y], like(ir, y), alpha=2.0)
    ms = ir.add("reduce", [p2], [ir.like(ir.recs[p2].dims[0])], {"fn": "mean", "axis": 1})
    ir.keep_whole(ir.recs[p2].dims[1])
    a = ew(ir, "affine", [ms], like(ir, ms), beta=1e-5)
    r = ew(ir, "rsqrt", [a], like(ir, a))
    out = like(ir, y)
    xr = ew(ir, "mul", [y, r], out, axes=[[0, 1], [0]])
    wn = const("wn", ir.like(out[1]))
    n = ew(ir, "mul", [wn, xr], like(ir, xr))
    lw, lb = const("lw", ir.like(d)), const("lb", ir.like(d))
    ln = ir.add("layernorm", [n, lw, lb], like(ir, n), {"axis": 1, "eps": 1e-5})
    ir.keep_whole(*ir.recs[n].dims[1:])
    # bidirectional attention over (tokens, heads, head dim) views of two projections
    hd = [ir.dim(H), ir.dim(E)]
    qkv = []
    for name in ("wq", "wk", "wv"):
        w = const(name, ir.like(hd[0]), ir.like(hd[1]), ir.like(d))
        qkv.append(ir.add("einsum", [ln, w], [ir.like(t), ir.like(hd[0]), ir.like(hd[1])],
                          {"idx": [[0, 1], [2, 3, 1]], "out": [0, 2, 3]}))  # fmt: skip
    for e in qkv[1:]:
        for a_, b_ in zip(ir.recs[e].dims, ir.recs[qkv[0]].dims, strict=True):
            ir.join(a_, b_)
    ir.keep_whole(*(ir.recs[e].dims[2] for e in qkv))
    att = ir.add("attention", qkv, like(ir, qkv[0]), {"scale": E**-0.5, "causal": False})
    sm = ir.add("softmax", [att], like(ir, att), {"axis": 2})
    ir.keep_whole(ir.recs[att].dims[2])
    tr = ir.add("relayout", [sm], [ir.like(ir.recs[sm].dims[i]) for i in (1, 0, 2)],
                {"perm": [1, 0, 2], "shape": [-1, -2, -3]})  # fmt: skip
    sl = ir.add("slice", [tr], [*ir.recs[tr].dims[:2], ir.dim(E // 2)], {"axis": 2, "start": 2, "stop": 6})
    ir.keep_whole(ir.recs[tr].dims[2])
    ct = ir.add("cat", [sl, sl], [ir.like(e) for e in ir.recs[sl].dims[:2]] + [ir.dim(E)], {"axis": 2})
    ir.keep_whole(ir.recs[ct].dims[2], ir.recs[sl].dims[2])
    sm2 = ir.add("reduce", [ct], [ir.like(e) for e in ir.recs[ct].dims[:2]], {"fn": "sum", "axis": 2})
    ir.outputs = [ln, sm2]
    return ir, vals


def numpy_reference(v):
    from math import erf

    x = v["x"].astype(np.float64)
    h = x @ v["w1"].T
    g = 0.5 * h * (1 + np.vectorize(erf)(h / np.sqrt(2)))
    y = x + g @ v["w2"].T
    n = y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-5) * v["wn"]
    mu, var = n.mean(-1, keepdims=True), n.var(-1, keepdims=True)
    ln = (n - mu) / np.sqrt(var + 1e-5) * v["lw"] + v["lb"]
    q, k, w = (np.einsum("td,hed->the", ln, v[n_]) for n_ in ("wq", "wk", "wv"))
    s = np.einsum("the,she->hts", q, k) * E**-0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    att = np.einsum("hts,she->the", p / p.sum(-1, keepdims=True), w)
    sm = np.exp(att - att.max(-1, keepdims=True))
    sm = (sm / sm.sum(-1, keepdims=True)).transpose(1, 0, 2)[:, :, 2:6]
    return ln, np.concatenate([sm, sm], axis=2).sum(-1)


def test_records_fuse_tile_offload_and_match_numpy():
    from turnip.compile import build_with_resident
    from turnip.graph import Tiling
    from turnip.memgraph.interp import NP_DTYPE, assemble
    from turnip.memgraph.verify import verify
    from turnip.runtime import execute, open_backend

    ir, vals = build(np.random.default_rng(0))
    fused = fuse(ir)
    assert fused["rmsnorm"] == 1 and fused["plain"] >= 1
    keep = live(ir)
    budget = 6_000
    blocks = choose_tiles(ir, keep, budget, n_gpus=2)
    g, values, tiles, order = emit(ir, keep, blocks)
    assert tiles and set(values) == {n for n in vals if n != "x"}
    tg = lower_imported(g, Tiling(tiles, n_gpus=2, parallel=order))
    mg = build_with_resident(tg, budget)
    assert verify(mg, tg) == [] and mg.stats["n_offload"] + mg.stats["n_reload"] > 0
    assert {"rmsnorm", "add_n", "layernorm", "softmax", "relayout", "slice", "cat", "reduce", "sdpa"} <= set(tg.op)
    blocks_in = {}
    for name, (_shape, bl) in tg.meta["input_blocks"].items():
        for starts, v in bl:
            sl = tuple(slice(s, s + k) for s, k in zip(starts, tg.shape[v], strict=True))
            blocks_in[v] = vals[name][sl].astype(NP_DTYPE[tg.dtype[v]])
    with open_backend("cpu", mg, 3, chaos=0.3) as be:
        be.write_inputs(blocks_in)
        execute(mg, be, "nondet", 3, seed=1)
        outs = be.read_outputs()
    want = numpy_reference(vals)
    for r, w in zip(ir.outputs, want, strict=True):
        got = assemble(tg, outs, ir.recs[r].name)
        np.testing.assert_allclose(got, w, rtol=2e-4, atol=2e-4)
