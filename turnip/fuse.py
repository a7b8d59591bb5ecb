"""Sums folded into the GEMMs that produce their terms: a taskgraph rewrite that removes vertices.

An ``einsum`` kernel may take a third operand, the *addend*: out = scale * einsum(a, b) + addend (one cuBLASLt
call: D = alpha A B + C with C the addend, ``cuda_kernels.cublaslt``). ``fold_adds(tg)`` rewrites

- an ``add_n`` whose inputs include einsums that nobody else reads (on the add's GPU, without an addend yet)
  and at most one other term into a chain of those einsums, each adding the previous link (the other term
  starts the chain): ``add_n(e1, e2, x)`` -> ``e1' = e1 + x``, ``e2' = e2 + e1'``;
- an accumulator (an einsum) with its ``sum_into`` partials, when every partial is an einsum on the
  accumulator's GPU that nobody else reads, into the chain ``acc``, ``p1 + acc``, ``p2 + (p1 + acc)``, ...
  in the group's index order (so the sum's order is fixed: reproducible under any dispatch order); when an
  add is the accumulator's only reader, the accumulator and its partials join that add's chain as terms.

Every reader of the add (of the accumulator) reads the chain's last link instead; each new vertex sits at
the position of the latest of its inputs (index order stays topological), so tensors live no longer than
before except an einsum's operands, which may wait for the previous link. Sums across GPUs (partials moved
by transfers) are left alone: a chain would serialise the GPUs. A LoRA training step of 7B loses about a
fifth of its vertices (every adapter's ``y + B A x``, the backward's gradient sums, the per-sequence
adapter-gradient sums); a prefill its residual adds where the contraction is not split.

State: none; ``fold_adds`` returns a new ``TaskGraph`` (index order topological by construction) whose
``meta`` block maps (``input_blocks``, ``output_blocks``) name the new vertex ids.
"""

from __future__ import annotations

import numpy as np

from turnip import ops
from turnip.memgraph.plan import KIND_KERNEL, csr
from turnip.taskgraph import TaskGraph


def _readers(tg: TaskGraph) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(tg.n)]
    for v in range(tg.n):
        for a in tg.args(v):
            out[int(a)].append(v)
    return out


def fold_adds(tg: TaskGraph) -> TaskGraph:
    """``tg`` with sums folded into einsums (module doc); ``tg`` itself when nothing folds."""
    readers = _readers(tg)
    si = tg.sum_intos()

    def alike(a: int, v: int) -> bool:
        """``a`` has ``v``'s shape and dtype (it can be ``v``'s addend: no broadcast, no cast)."""
        return tg.shape[a] == tg.shape[v] and tg.dtype[a] == tg.dtype[v]

    def foldable(e: int, user: int) -> bool:
        """``e`` an einsum without addend that only ``user`` reads, on ``user``'s GPU, not an output."""
        return (tg.kind[e] == KIND_KERNEL and tg.op[e] == "einsum" and len(tg.args(e)) == 2
                and readers[e] == [user] and e not in si and not tg.is_output[e] and tg.gpu[e] == tg.gpu[user]
                and alike(e, user))  # fmt: skip

    def group_parts(a: int) -> list[int] | None:
        """The partials of accumulator ``a`` when ``a`` is an einsum and each partial a foldable einsum on its
        GPU, else None."""
        if not (tg.op[a] == "einsum" and a in si and len(tg.args(a)) == 2):
            return None
        parts = [int(tg.args(s)[1]) for s in si[a]]
        ok = all(foldable(p, s) and tg.gpu[p] == tg.gpu[a] for p, s in zip(parts, si[a], strict=True))
        return parts if ok else None

    # an accumulator whose only other reader is an add (its partials all foldable) joins that add's chain
    absorbed: dict[int, int] = {}
    for v in range(tg.n):
        if tg.op[v] == "add_n" and tg.kind[v] == KIND_KERNEL:
            args = [int(x) for x in tg.args(v)]
            mine = [a for a in args if group_parts(a) is not None and sorted(readers[a]) == sorted([v, *si[a]])
                    and not tg.is_output[a] and tg.gpu[a] == tg.gpu[v] and alike(a, v)]  # fmt: skip
            others = [a for a in args if a not in mine and not foldable(a, v)]
            if len(set(args)) == len(args) and (not others or len(others) == 1 and alike(others[0], v)):
                absorbed.update((a, v) for a in mine)

    # plan: per removed vertex nothing; per rewritten sum the list of new links
    drop: set[int] = set()
    links: dict[int, list[tuple]] = {}  # position (old id) -> new vertices emitted right after it
    alias: dict[int, tuple] = {}  # old tensor -> what its readers read instead: ("new", key), ("old", t), ("raw", v)
    order = 0

    def emit_at(pos: int, rec: tuple) -> tuple:
        nonlocal order
        order += 1
        key = (pos, order)
        links.setdefault(pos, []).append((key, rec))
        return key

    def pos_of(ref: tuple) -> int:  # where what ``ref`` names is computed (an aliased tensor: its chain's end)
        kind, x = ref
        return x[0] if kind == "new" else pos_of(alias[x]) if kind == "old" and x in alias else x

    for v in range(tg.n):
        if tg.kind[v] != KIND_KERNEL:
            continue
        if tg.op[v] == "add_n":
            args = [int(a) for a in tg.args(v)]
            if len(args) < 2 or len(set(args)) != len(args):
                continue
            mine = [a for a in args if absorbed.get(a) == v]
            fold = [a for a in args if foldable(a, v)] + [e for a in mine for e in (a, *group_parts(a))]
            rest = [a for a in args if a not in fold]
            if not fold or len(rest) > 1:  # other terms would need an add of their own: no vertex saved
                continue
            if rest and not alike(rest[0], v):
                continue  # a broadcast term (a bias) is no addend
            for a in mine:
                drop.update(si[a])
            fold.sort()
            acc: tuple | None = ("old", rest[0]) if rest else None
            for e in fold:
                if acc is None:
                    acc = ("old", e)
                    continue
                acc = ("new", emit_at(max(e, pos_of(acc)), ("fold", e, acc)))
                drop.add(e)
            drop.add(v)
            alias[v] = acc
        elif v not in absorbed and (parts := group_parts(v)) is not None:
            group = si[v]
            acc = ("raw", v)  # the accumulator itself (its readers read the chain's end)
            for s, p in zip(group, parts, strict=True):
                acc = ("new", emit_at(max(s, pos_of(acc)), ("fold", p, acc)))
                drop.update((s, p))
            alias[v] = acc
    if not drop:
        return tg
    return _rebuild(tg, drop, links, alias)


def _rebuild(tg: TaskGraph, drop: set, links: dict, alias: dict) -> TaskGraph:
    """The new taskgraph: kept vertices copied (their sizes and work as they were), links inserted."""
    new_of_old: dict[int, int] = {}
    new_of_key: dict[tuple, int] = {}

    def ref(r: tuple) -> int:  # ("new", key): a new link; ("raw", v): vertex v itself; ("old", t): read(t)
        kind, x = r
        return new_of_key[x] if kind == "new" else new_of_old[x] if kind == "raw" else read(x)

    def read(a: int) -> int:  # what a reader of old tensor ``a`` reads now
        r = alias.get(a)
        return new_of_old[a] if r is None else ref(r)

    args_of: list[list[int]] = []
    src: list[int] = []  # old vertex whose row a new vertex copies (its kind, gpu, dtype, ...)
    ops_, params, shapes, flops, names, acc = [], [], [], [], [], []
    for v in range(tg.n):
        if v not in drop:
            a = [int(x) for x in tg.args(v)]
            new_of_old[v] = len(src)
            args_of.append([new_of_old[a[0]], read(a[1])] if tg.acc[v] >= 0 else [read(x) for x in a])
            src.append(v)
            ops_.append(tg.op[v])
            params.append(tg.params[v])
            shapes.append(tg.shape[v])
            flops.append(float(tg.flops[v]))
            names.append(tg.name[v])
            acc.append(new_of_old[int(tg.acc[v])] if tg.acc[v] >= 0 else -1)
        for key, rec in links.get(v, ()):
            _, like, accr = rec
            x, y = (int(u) for u in tg.args(like))
            a = [read(x), read(y), ref(accr)]
            op, p, name = "einsum", tg.params[like], tg.name[like] + "+"
            in_shapes = [shapes[u] for u in a]
            new_of_key[key] = len(src)
            args_of.append(a)
            src.append(like)
            ops_.append(op)
            params.append(p)
            shapes.append(tg.shape[like])
            flops.append(ops.flops(op, in_shapes, tg.shape[like], p))
            names.append(name)
            acc.append(-1)
    outs = [read(int(v)) for v in np.flatnonzero(tg.is_output)]
    ix = np.asarray(src, dtype=np.int64)
    ptr, idx = csr(args_of)
    bad = np.flatnonzero(idx >= np.repeat(np.arange(len(src)), np.diff(ptr)))
    if len(bad):  # cannot happen (each link sits after its inputs); a cheap guard instead of a full validate
        raise AssertionError(f"folding sums broke the topological order at arg {bad[0]}")
    is_out = np.zeros(len(src), dtype=bool)
    is_out[outs] = True
    meta = dict(tg.meta)
    for k in ("input_blocks", "output_blocks"):
        if k in meta:
            meta[k] = {name: (shape, [(c, read(int(x))) for c, x in blocks])
                       for name, (shape, blocks) in meta[k].items()}
    for v in np.flatnonzero(tg.is_output):  # an output's name stays its (the final link's) name
        names[read(int(v))] = tg.name[v]
    return TaskGraph(n_gpus=tg.n_gpus, kind=tg.kind[ix], gpu=tg.gpu[ix], src_gpu=tg.src_gpu[ix], op=ops_,
                     params=params, shape=shapes, dtype=[tg.dtype[v] for v in src], nbytes=tg.nbytes[ix],
                     flops=np.asarray(flops, dtype=np.float64), arg_ptr=ptr, arg_idx=idx,
                     acc=np.asarray(acc, dtype=np.int32), is_output=is_out, name=names, meta=meta)
