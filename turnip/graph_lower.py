"""Lowering rules for contractions and attention (see ``turnip.graph``): the two ops whose tiles split a
reduced dimension and therefore need partial results plus a combine step."""

from __future__ import annotations

import itertools

from turnip.taskgraph import Builder


def _accumulate(b: Builder, parts: list[int], gpu: int, moves: dict, name: str) -> int:
    """Sum partial tiles on ``gpu``: the first (moved there) is the accumulator, the rest sum into it."""
    acc = b.to_gpu(parts[0], gpu, moves)
    for i, p in enumerate(parts[1:], 1):
        b.sum_into(acc, b.to_gpu(p, gpu, moves), name=f"{name}+={i}")
    return acc


def lower_einsum(lw, node) -> None:
    T, g, b = lw.T, lw.g, lw.b
    ins, out_l = node.params["subscripts"].split("->")
    la, lb = ins.split(",")
    ta, tb = (g.t(x) for x in node.inputs)
    ext = dict(zip(la, ta.shape, strict=True)) | dict(zip(lb, tb.shape, strict=True))
    contracted = [l for l in dict.fromkeys(la + lb) if l not in out_l]
    t = node.out
    blocks = {}
    for idx in lw.grid(t):
        oc = dict(zip(out_l, idx, strict=True))
        parts = []
        for cidx in itertools.product(*(range(T.nblocks(l, ext[l])) for l in contracted)):
            coords = oc | dict(zip(contracted, cidx, strict=True))
            gpu = T.place(coords)
            sizes = {l: (lambda s: s[1] - s[0])(T.span(l, ext[l], coords[l])) for l in ext}
            shape = tuple(sizes[l] for l in out_l)
            args = [lw.block(x, coords, gpu) for x in node.inputs]
            parts.append(
                b.kernel(
                    "einsum",
                    args,
                    shape,
                    t.dtype,
                    gpu,
                    node.params,
                    name=f"{t.name}{list(idx)}{list(cidx) if contracted else ''}",
                )
            )
        blocks[idx] = (
            _accumulate(b, parts, T.place(oc), lw.moves, f"{t.name}{list(idx)}") if len(parts) > 1 else parts[0]
        )
    lw.blocks[t.id] = blocks


def lower_attention(lw, node) -> None:
    T, b = lw.T, lw.b
    q, k, v = node.inputs
    t = node.out
    tl, hl, el = t.dims
    lw.whole(t, el, "attention")
    n_tok, n_head, dh = t.shape
    scale = node.params["scale"]
    blocks = {}
    for idx in lw.grid(t):
        qi, hb = idx[0], idx[1]
        coords = {tl: qi, hl: hb}
        gpu = T.place(coords)
        q0, q1 = T.span(tl, n_tok, qi)
        h0, h1 = T.span(hl, n_head, hb)
        nh, tq = h1 - h0, q1 - q0
        qv = lw.block(q, coords, gpu)
        name = f"{t.name}{list(idx)}"
        scores, maxes = [], []
        for kj in range(T.nblocks(tl, n_tok)):
            k0, k1 = T.span(tl, n_tok, kj)
            if k0 > q1 - 1:
                break  # fully masked
            kc = {tl: kj, hl: hb}
            p = {"scale": scale, "q_off": q0, "k_off": k0, "causal": True}
            s = b.kernel(
                "attn_scores",
                [qv, lw.block(k, kc, gpu)],
                (nh, tq, k1 - k0),
                t.dtype,
                gpu,
                p,
                name=f"{name}.S{kj}",
            )
            scores.append((s, kc, k1 - k0))
            maxes.append(
                b.kernel("rowmax", [s], (nh, tq), t.dtype, gpu, name=f"{name}.m{kj}")
            )
        m = (
            maxes[0]
            if len(maxes) == 1
            else b.kernel("max_n", maxes, (nh, tq), t.dtype, gpu, name=f"{name}.m")
        )
        sums, parts = [], []
        for j, (s, kc, tk) in enumerate(scores):
            e = b.kernel("exp_sub", [s, m], (nh, tq, tk), t.dtype, gpu, name=f"{name}.E{j}")
            sums.append(b.kernel("rowsum", [e], (nh, tq), t.dtype, gpu, name=f"{name}.l{j}"))
            parts.append(
                b.kernel(
                    "einsum",
                    [e, lw.block(v, kc, gpu)],
                    (tq, nh, dh),
                    t.dtype,
                    gpu,
                    {"subscripts": "hqk,khd->qhd", "scale": 1.0},
                    name=f"{name}.PV{j}",
                )
            )
        l = (
            sums[0]
            if len(sums) == 1
            else b.kernel("add_n", sums, (nh, tq), t.dtype, gpu, name=f"{name}.l")
        )
        o = _accumulate(b, parts, gpu, lw.moves, f"{name}.O")
        blocks[idx] = b.kernel("div_rows", [o, l], (tq, nh, dh), t.dtype, gpu, name=name)
    lw.blocks[t.id] = blocks
