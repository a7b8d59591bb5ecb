"""Lowering rules for contractions and attention (see ``turnip.graph``): the two ops whose tiles split a
reduced dimension and therefore need partial results plus a combine step."""

from __future__ import annotations

import itertools
import os

from turnip.memgraph.plan import DTYPE_NBYTES
from turnip.taskgraph import Builder


class TilingError(ValueError):  # turnip.graph's (re-exported there)
    pass


LEAN_SWITCH = "TURNIP_LEAN_STEP"  # "0": the data split's sums across GPUs as sum_into chains, sends where used


def lean_step_on() -> bool:
    """Whether the data split sums partials across GPUs with one ``add_n`` per block (its terms' transfers
    first) instead of a ``sum_into`` per term, and sends a training step's adapters at its start
    (``turnip.train.hoist_sends``): on unless ``TURNIP_LEAN_STEP=0``. On four H100s a 7B LoRA step (8 x 1K,
    16 GiB per GPU) has 6,136 launch units instead of 11,250 and takes 219.4 ms instead of 328.0 (199.8 with
    the default end events), `turnip train` on 2 GPUs 361.7 ms instead of 386.0
    (``benchmarks/results/multi_gpu/README.md``)."""
    return os.environ.get(LEAN_SWITCH, "1") != "0"


def _accumulate(b: Builder, parts: list[int], gpu: int, moves: dict, name: str, local: bool = False) -> int:
    """Sum partial tiles on ``gpu``: the first (moved there) is the accumulator, the rest sum into it. With
    ``local`` (the data split: each GPU the partials of its sequences), where another GPU holds several
    partials, they are summed there first and their sum moves once; with ``lean_step_on()`` too, each of
    those sums is one ``add_n`` of its terms in order (every term moved first): one kernel, no lock, the same
    order whatever order the terms arrive in."""
    by_gpu: dict[int, list[int]] = {}
    for p in parts:
        by_gpu.setdefault(b.gpu_of(p), []).append(p)
    if local and lean_step_on():
        parts = [_add_on(b, ps, g, f"{name}@gpu{g}") for g, ps in by_gpu.items()]
        return _add_on(b, [b.to_gpu(p, gpu, moves) for p in parts], gpu, name)
    if local and any(len(ps) > 1 for g, ps in by_gpu.items() if g != gpu):
        parts = [x for g, ps in by_gpu.items()
                 for x in (ps if g == gpu or len(ps) == 1 else [_sum_on(b, ps, f"{name}@gpu{g}")])]  # fmt: skip
    acc = b.to_gpu(parts[0], gpu, moves)
    for i, p in enumerate(parts[1:], 1):
        b.sum_into(acc, b.to_gpu(p, gpu, moves), name=f"{name}+={i}")
    return acc


def _add_on(b: Builder, parts: list[int], gpu: int, name: str) -> int:
    """One ``add_n`` of ``parts`` (all on ``gpu``) in their order; a single part is itself."""
    if len(parts) == 1:
        return parts[0]
    return b.kernel("add_n", parts, b.shape_of(parts[0]), b.rows[parts[0]][6], gpu, {}, name=f"{name}+")


def _sum_on(b: Builder, parts: list[int], name: str) -> int:
    """The sum of partial tiles on their own GPU: the first is the accumulator."""
    for i, p in enumerate(parts[1:], 1):
        b.sum_into(parts[0], p, name=f"{name}+={i}")
    return parts[0]


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
            _accumulate(b, parts, T.place(oc), lw.moves, f"{t.name}{list(idx)}", local=bool(T.replicate))
            if len(parts) > 1
            else parts[0]
        )
    lw.blocks[t.id] = blocks


def lower_attention(lw, node) -> None:
    """Per (query block, head block) one fused ``sdpa`` vertex per key range: key blocks are concatenated
    into ranges of ``tiles["kv"]`` tokens (default: the whole sequence; one block needs no concat); the
    range holding the diagonal is read up to the query block's end (causal, no masked work). Several
    ranges give partial outputs with their log-sum-exp, merged by one ``attn_combine``. Under the layers
    split the diagonal range stops at the query block (a concatenation per query block): a token tile then
    never waits for a later one, so a pipeline stage can pass it on before the later tiles arrive. With a
    sliding ``window``, key ranges are clipped to the blocks a query block's window reaches (from the block
    holding its first query's first key to the query block itself), one range where those blocks fit one:
    no vertex reads a fully masked key block, and the ``sdpa`` vertices mask the rest (``window`` param)."""
    T, b = lw.T, lw.b
    q, k, v = node.inputs
    t = node.out
    tl, hl = t.dims[0], t.dims[1]
    for letter in t.dims[2:]:  # the head dim, and the group of query heads per key-value head
        lw.whole(t, letter, "attention")
    n_tok, n_head, dh = t.shape[0], t.shape[1], t.shape[-1]
    group = t.shape[2] if len(t.shape) == 4 else 1
    nb = T.nblocks(tl, n_tok)
    tile = T.tiles.get(tl, n_tok)
    per_range = max(1, int(T.tiles.get("kv", n_tok)) // tile)  # key blocks per range
    itemsize = DTYPE_NBYTES[t.dtype]
    seq = lw.seq_of(node)
    if lw.packs(node):
        return _packed_attention(lw, node, seq, itemsize, group)
    seq_blocks = nb if seq >= n_tok else seq // tile  # token blocks per sequence
    causal = T.parallel in ("layers", "t")  # token tiles on several GPUs: a query block reads no later block
    window = int(node.params.get("window", 0))
    extra = {k: node.params[k] for k in ("window", "softcap") if k in node.params}
    ranges: dict = {}

    def key_range(x: int, hb: int, j0: int, j1: int, gpu: int) -> int:
        key = (x, hb, j0, j1, gpu)
        if key not in ranges:
            parts = [lw.block(x, {tl: j, hl: hb}, gpu) for j in range(j0, j1)]
            if len(parts) == 1:
                ranges[key] = parts[0]
            else:
                shape = b.shape_of(parts[0])
                rows = sum(b.shape_of(p)[0] for p in parts)
                name = f"{lw.g.t(x).name}[{j0}:{j1},{hb}]"
                ranges[key] = b.kernel("concat", parts, (rows, *shape[1:]), t.dtype, gpu, {}, name=name)
        return ranges[key]

    blocks = {}
    for idx in lw.grid(t):
        qi, hb = idx[0], idx[1]
        coords = {tl: qi, hl: hb}
        gpu = T.place(coords)
        q0, q1 = T.span(tl, n_tok, qi)
        h0, h1 = T.span(hl, n_head, hb)
        nh, tq = h1 - h0, q1 - q0
        nq = nh * group  # query heads of the block
        out_shape = (tq, nh, group, dh) if group > 1 else (tq, nh, dh)
        qv = lw.block(q, coords, gpu)
        name = f"{t.name}{list(idx)}"
        first = qi // seq_blocks * seq_blocks  # the sequence's first block and token
        s0 = T.span(tl, n_tok, first)[0]
        last = min(first + seq_blocks, nb)
        spans = []  # the key blocks [j0, j1) of each key range
        jmin = max(first, (q0 - window + 1) // tile) if window else first  # the window's first key block
        if window and qi + 1 - jmin <= per_range:  # the window's blocks fit one key range: one vertex
            spans.append((jmin, qi + 1))
        for r in range(0 if spans else (qi - first) // per_range + 1):
            j0 = first + r * per_range
            j1 = min(j0 + per_range, last, qi + 1 if causal or window else last)
            if max(j0, jmin) < j1:
                spans.append((max(j0, jmin), j1))
        n_ranges = len(spans)
        parts = []
        for r, (j0, j1) in enumerate(spans):
            k0 = T.span(tl, n_tok, j0)[0]
            kv = tuple(key_range(x, hb, j0, j1, gpu) for x in (k, v))
            rows = b.shape_of(kv[0])[0]
            p = {"scale": node.params["scale"], "causal": True, "q_off": q0 - s0, "k_off": k0 - s0,
                 "tk": min(rows, q1 - k0), "partial": n_ranges > 1, "itemsize": itemsize} | extra  # fmt: skip
            shape = (tq * nq * dh + nq * tq * 4 // itemsize,) if n_ranges > 1 else out_shape
            vname = f"{name}.A{r}" if n_ranges > 1 else name
            parts.append(b.kernel("sdpa", [qv, *kv], shape, t.dtype, gpu, p, name=vname))
        if n_ranges == 1:
            blocks[idx] = parts[0]
        else:
            p = {"tq": tq, "h": nq, "dh": dh, "itemsize": itemsize} | ({"r": group} if group > 1 else {})
            blocks[idx] = b.kernel("attn_combine", parts, out_shape, t.dtype, gpu, p, name=name)
    lw.blocks[t.id] = blocks


def _packed_attention(lw, node, seq: int, itemsize: int, group: int) -> None:
    """Token tiles of whole sequences: one ``sdpa`` vertex per (token block, head block) over the block's own
    keys, each of its sequences apart (``seq`` param)."""
    T, b = lw.T, lw.b
    q, k, v = node.inputs
    t = node.out
    tl, hl = t.dims[0], t.dims[1]
    extra = {x: node.params[x] for x in ("window", "softcap") if x in node.params}
    blocks = {}
    for idx in lw.grid(t):
        coords = {tl: idx[0], hl: idx[1]}
        gpu = T.place(coords)
        args = [lw.block(x, coords, gpu) for x in (q, k, v)]
        rows = b.shape_of(args[0])[0]
        p = {"scale": node.params["scale"], "causal": True, "q_off": 0, "k_off": 0, "tk": rows, "partial": False,
             "itemsize": itemsize, "seq": seq} | extra  # fmt: skip
        blocks[idx] = b.kernel("sdpa", args, lw.bshape(t, idx), t.dtype, gpu, p, name=f"{t.name}{list(idx)}")
    lw.blocks[t.id] = blocks


def lower_attention_bwd(lw, node) -> None:
    """One ``sdpa_bwd`` vertex per (sequence, key-value head block): training keeps each sequence in one
    token tile (its gradients for keys and values then need no accumulation across query blocks)."""
    T, b = lw.T, lw.b
    q, k, v, o, do = node.inputs
    t = node.out
    tl, hl = t.dims[0], t.dims[1]
    lw.whole(t, t.dims[2], "attention_bwd")
    qt = lw.g.t(q)
    for letter in qt.dims[2:]:
        lw.whole(qt, letter, "attention_bwd")
    n_tok = t.shape[0]
    seq = lw.seq_of(node)
    tile = min(T.tiles.get(tl, n_tok), n_tok)
    if tile % seq:
        raise TilingError(f"attention backward {t.name}: a sequence must be one token tile (t={seq}) or a tile hold "
                          f"whole sequences, not t={tile}")  # fmt: skip
    pack = {"seq": seq} if tile > seq else {}
    blocks = {}
    for idx in lw.grid(t):
        coords = {tl: idx[0], hl: idx[1]}
        gpu = T.place(coords)
        args = [lw.block(x, coords, gpu) for x in (q, k, v, o, do)]
        p = {"scale": node.params["scale"], "causal": True, "q_off": 0, "k_off": 0} | pack
        blocks[idx] = b.kernel("sdpa_bwd", args, lw.bshape(t, idx), t.dtype, gpu, p, name=f"{t.name}{list(idx)}")
    lw.blocks[t.id] = blocks
