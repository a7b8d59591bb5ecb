"""Reverse-mode differentiation of a logical graph (``turnip.graph``): the backward pass as more nodes of the
same graph, tiled and placed by the same lowering as the forward.

``backward(g, seeds, wrt)`` appends, in reverse order of the forward nodes, the gradient of every node on a
path from a tensor of ``wrt`` to a seeded tensor, and returns the gradient of each tensor of ``wrt``.
Gradients flow only where they are needed: a node is differentiated when one of its inputs depends on
``wrt`` (frozen weights and the embedded prompt get none). A tensor read by several nodes sums its
contributions with one ``add_n``.

Rules (``dy``: the gradient of the node's output):
  einsum(a, b)       da = einsum(dy, b), db = einsum(dy, a), same scale (contractions of their own)
  add_n, cast        every input gets dy (cast back to its dtype)
  mul, scale         da = dy * b, db = dy * a; dx = alpha * dy
  silu_mul(g, u)     dg = silu_mul_dg(g, u, dy), du = silu_mul(g, dy)
  rmsnorm(x, w)      dx = rmsnorm_bwd(x, w, dy) (w frozen)
  rotary(x)          dx = rotary(dy) rotating backwards (the transpose)
  attention(q,k,v)   one attention_bwd node, its parts taken out by cols
Other ops raise ``ValueError`` naming the node.

Layers: the gradient nodes of a node belong to its layer (``Node.layer``), recomputed copies to their
original's, and the sum of a tensor's contributions to the latest layer of the nodes that gave them (its
readers): a layer's output, read by the next layer, has its gradient summed there and sent down once.

Activation checkpointing: ``recompute`` lists segments (node ids of the forward, e.g. one decoder layer);
the backward of a segment reads recomputed copies of its nodes, cloned just before that backward, so the
forward's own activations die with the forward and only the segments' inputs are kept.
"""

from __future__ import annotations

from collections.abc import Iterable

from turnip.graph import Graph

DIFFERENTIABLE = {"einsum", "add_n", "cast", "mul", "scale", "silu_mul", "rmsnorm", "rotary", "attention"}


def needs_grad(g: Graph, wrt: Iterable[int]) -> set[int]:
    """The tensors that depend on a tensor of ``wrt`` (``wrt`` included)."""
    need = set(wrt)
    for node in g.nodes:
        if node.op != "input" and any(x in need for x in node.inputs):
            need.add(node.out.id)
    return need


def backward(
    g: Graph, seeds: dict[int, int], wrt: list[int], recompute: list[list[int]] | None = None
) -> dict[int, int]:
    """Append the backward pass of ``g`` to it. ``seeds``: tensor -> its gradient (e.g. logits -> d logits);
    ``wrt``: the tensors whose gradients are wanted (returned as tensor -> gradient tensor; a tensor without
    a path to a seed is missing). ``recompute``: checkpointed segments (module doc)."""
    need = needs_grad(g, wrt)
    contrib: dict[int, list[tuple[int, int | None]]] = {x: [(gx, g.nodes[gx].layer)] for x, gx in seeds.items()}
    segment_of = {x: i for i, seg in enumerate(recompute or []) for x in seg}
    fwd: dict[int, int] = {}  # forward tensor -> its recomputed copy (segments already recomputed)
    done_segments: set[int] = set()
    wanted = set(wrt)
    out: dict[int, int] = {}
    for x in range(max(seeds, default=-1), -1, -1):
        node = g.nodes[x]
        if x not in need or x not in contrib:
            continue
        dy = _total(g, contrib.pop(x), x)
        if x in wanted:
            out[x] = dy
        if node.op == "input":
            continue
        s = segment_of.get(x)
        if s is not None and s not in done_segments:
            done_segments.add(s)
            fwd.update(_clone(g, recompute[s], fwd))
        with g.layer_scope(node.layer):
            for inp, gi in _rule(g, node, dy, need, fwd):
                contrib.setdefault(inp, []).append((gi, node.layer))
    return out


def _total(g: Graph, parts: list[tuple[int, int | None]], x: int) -> int:
    """The gradient of ``x`` from its (contribution, layer of the reader that gave it) parts."""
    if len(parts) == 1:
        return parts[0][0]
    layers = [layer for _, layer in parts]
    with g.layer_scope(None if None in layers else max(layers)):
        return g.map("add_n", *(p for p, _ in parts), name=f"d{g.t(x).name}")


def _clone(g: Graph, segment: list[int], fwd: dict[int, int]) -> dict[int, int]:
    """Recompute a segment's nodes (in forward order) from its inputs; returns old -> new tensor ids."""
    new: dict[int, int] = {}
    for x in sorted(segment):
        node = g.nodes[x]
        if node.op == "input":
            continue
        ins = tuple(new.get(i, fwd.get(i, i)) for i in node.inputs)
        t = node.out
        with g.layer_scope(node.layer):
            new[x] = g._new(node.op, ins, t.dims, t.shape, node.params, name=t.name + "'", dtype=t.dtype)
    return new


def _rule(g: Graph, node, dy: int, need: set[int], fwd: dict[int, int]) -> list[tuple[int, int]]:
    """(input, gradient contribution) for the inputs of ``node`` that need a gradient."""
    F = lambda i: fwd.get(i, i)  # noqa: E731 - the forward value as the backward reads it
    op, ins, t = node.op, node.inputs, node.out
    name = "d" + t.name
    wants = [i in need for i in ins]
    res: list[tuple[int, int]] = []
    if op == "einsum":
        lhs, lo = node.params["subscripts"].split("->")
        la, lb = lhs.split(",")
        sc = node.params.get("scale", 1.0)
        for k, (mine, other, o) in enumerate(((la, lb, ins[1]), (lb, la, ins[0]))):
            if not wants[k]:
                continue
            if any(c not in lo + other for c in mine):
                raise ValueError(f"einsum {node.params['subscripts']} ({t.name}): a letter of {mine!r} is summed "
                                 "away by itself; its gradient is not supported")  # fmt: skip
            sub = f"{lo},{other}->{mine}"
            res.append((ins[k], g.einsum(sub, dy, F(o), scale=sc, name=f"{name}/{g.t(ins[k]).name}")))
    elif op in ("add_n", "cast"):
        for i, w in zip(ins, wants, strict=True):
            if not w:
                continue
            ti = g.t(i)
            if ti.dims != t.dims:
                raise ValueError(f"{op} {t.name}: input {ti.name} broadcasts; its gradient is not supported")
            res.append((i, dy if ti.dtype == t.dtype else g.cast(dy, ti.dtype, name=f"{name}/{ti.name}")))
    elif op == "scale":
        res.append((ins[0], g.map("scale", dy, alpha=node.params["alpha"], name=name)))
    elif op == "mul":
        for k in (0, 1):
            if wants[k]:
                if g.t(ins[k]).dims != t.dims:
                    raise ValueError(f"mul {t.name}: input {g.t(ins[k]).name} broadcasts; not supported")
                res.append((ins[k], g.map("mul", dy, F(ins[1 - k]), name=f"{name}/{k}")))
    elif op == "silu_mul":
        gate, up = F(ins[0]), F(ins[1])
        if wants[0]:
            res.append((ins[0], g.map("silu_mul_dg", gate, up, dy, name=name + "/gate")))
        if wants[1]:
            res.append((ins[1], g.map("silu_mul", gate, dy, name=name + "/up")))
    elif op == "rmsnorm":
        if wants[1]:
            raise ValueError(f"rmsnorm {t.name}: gradients of the norm weight {g.t(ins[1]).name} are not supported")
        res.append((ins[0], g.rmsnorm_bwd(F(ins[0]), F(ins[1]), dy, eps=node.params.get("eps", 1e-5), name=name)))
    elif op == "rotary":
        p = dict(node.params, inverse=not node.params.get("inverse", False))
        x = g._new("rotary", (dy,), t.dims, t.shape, p, name=name, dtype=t.dtype)
        res.append((ins[0], x))
    elif op == "attention":
        q, k, v = ins
        tq, tk = g.t(q), g.t(k)
        pk = g.attention_bwd(F(q), F(k), F(v), F(t.id), dy, seq=node.params.get("seq"), name=name)
        rq = (tq.shape[2] if len(tq.shape) == 4 else 1) * tq.shape[-1]
        e = tk.shape[-1]
        if wants[0]:
            res.append((q, g.cols(pk, 0, rq, tq.dims, tq.shape, name=name + "/q")))
        if wants[1]:
            res.append((k, g.cols(pk, rq, rq + e, tk.dims, tk.shape, name=name + "/k")))
        if wants[2]:
            res.append((v, g.cols(pk, rq + e, rq + 2 * e, g.t(v).dims, g.t(v).shape, name=name + "/v")))
    else:
        raise ValueError(f"no gradient rule for op {op!r} (node {t.name}); differentiable: {sorted(DIFFERENTIABLE)}")
    return res
