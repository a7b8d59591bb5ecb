"""The importer's tensor records, automatic tiling and emission as a ``turnip.graph.Graph``.

State: ``IR.recs`` (one record per tensor, inputs first-come) and ``IR.ext``/``IR.parent`` (every dimension
of every record has an integer id; a union-find joins the dimensions that must be tiled alike: the two sides
of an elementwise op, the shared indices of a contraction, the token and head axes of attention).
Invariants: joined dimensions have equal extents; a class marked ``whole`` (a reduced, normalised, sliced or
concatenated axis, a head dimension, or a class that occurs twice in one tensor) is never tiled.

Dimension letters matter only for tiled classes: a tiled class is one upper-case letter everywhere (classes of
one tile size that never meet in a vertex share it), and every other dimension gets a lower-case letter local
to its tensor (one block, so the lowering never looks it up).
Einsum subscripts are written per contraction with the same rule, so a contraction can pair dimensions that
were created apart.
"""

from __future__ import annotations

import dataclasses
import math
import string
from dataclasses import dataclass, field

import numpy as np

from turnip.graph import Graph, Tiling, _Lowering
from turnip.graph_lower import lower_attention
from turnip.memgraph.interp import NP_DTYPE
from turnip.memgraph.plan import DTYPE_NBYTES
from turnip.taskgraph import TaskGraph


@dataclass(slots=True)
class Rec:
    op: str
    inputs: list[int]
    dims: list[int]  # dimension ids in memory order
    params: dict
    name: str
    dtype: str
    value: np.ndarray | None = None  # the data of a constant input (float32 or int32; ``dtype`` at emission)


@dataclass
class IR:
    dtype: str = "fp32"
    recs: list[Rec] = field(default_factory=list)
    ext: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    whole: set = field(default_factory=set)  # dimension ids (any member marks its class)
    outputs: list[int] = field(default_factory=list)

    def dim(self, extent: int) -> int:
        self.ext.append(int(extent))
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, d: int) -> int:
        while self.parent[d] != d:
            self.parent[d] = self.parent[self.parent[d]]
            d = self.parent[d]
        return d

    def join(self, a: int, b: int) -> None:
        if self.ext[a] != self.ext[b]:
            raise ValueError(f"joining dimensions of extents {self.ext[a]} and {self.ext[b]}")
        self.parent[self.find(a)] = self.find(b)

    def like(self, d: int) -> int:
        """A new dimension joined to ``d``."""
        n = self.dim(self.ext[d])
        self.join(n, d)
        return n

    def keep_whole(self, *ds: int) -> None:
        self.whole.update(ds)

    def add(self, op: str, inputs, dims, params=None, name: str = "", dtype: str | None = None, value=None) -> int:
        self.recs.append(Rec(op, list(inputs), list(dims), dict(params or {}), name or f"{op}{len(self.recs)}",
                             dtype or self.dtype, value))  # fmt: skip
        return len(self.recs) - 1

    def shape(self, r: int) -> tuple[int, ...]:
        return tuple(self.ext[d] for d in self.recs[r].dims)

    def nbytes(self, r: int) -> int:
        return math.prod(self.shape(r)) * DTYPE_NBYTES[self.recs[r].dtype]


def tileable(ir: IR, live: list[int]) -> set[int]:
    """The class roots that may be tiled: not whole, never twice in one tensor, larger than 1."""
    no = {ir.find(d) for d in ir.whole}
    for r in (ir.recs[i] for i in live):
        roots = [ir.find(d) for d in r.dims]
        no.update(x for x in roots if roots.count(x) > 1)
    return {ir.find(d) for i in live for d in ir.recs[i].dims if ir.ext[d] > 1} - no


MIN_TILE = 4  # automatic tiling stops halving a dimension's tile here


def choose_tiles(ir: IR, live: list[int], budget_nbytes: int | None, n_gpus: int = 1) -> dict[int, int]:
    """Blocks per tiled class: in rounds, each vertex above a quarter of the budget (its inputs plus its output)
    halves the largest tile of its largest tensor, until every vertex fits; every class of a weight matrix
    that allows it starts at max(2, GPUs) blocks (as the LLaMA builder splits heads, FFN and vocabulary).
    A vertex that no tile shrinks (a whole embedding table) is left as it is: BuildMemgraph says if it does not
    fit."""
    ok = tileable(ir, live)
    blocks = dict.fromkeys(ok, 1)

    def tile(d: int) -> int:
        r = ir.find(d)
        return -(-ir.ext[d] // blocks.get(r, 1))

    def block_nbytes(r: int) -> int:
        return math.prod(tile(d) for d in ir.recs[r].dims) * DTYPE_NBYTES[ir.recs[r].dtype]

    for i in live:  # weight dimensions (heads, FFN, vocabulary) in at least max(2, GPUs) blocks, as the builder
        r = ir.recs[i]
        if r.value is not None and r.value.ndim > 1:
            for d in r.dims:
                c = ir.find(d)
                if c in blocks and ir.ext[c] >= 2 * MIN_TILE * max(2, n_gpus):
                    blocks[c] = max(blocks[c], max(2, n_gpus))
    if budget_nbytes is None:
        return blocks
    cap = budget_nbytes // 4
    kernels = [i for i in live if ir.recs[i].op != "input"]
    for _ in range(64):  # every round halves one tile of each vertex above the cap
        cost = {i: block_nbytes(i) + sum(block_nbytes(j) for j in ir.recs[i].inputs) for i in kernels}
        split = set()
        for worst in (i for i in kernels if cost[i] > cap):
            shrink = {j: [ir.find(d) for d in ir.recs[j].dims if ir.find(d) in blocks and tile(d) > MIN_TILE]
                      for j in dict.fromkeys((worst, *ir.recs[worst].inputs))}  # fmt: skip
            part = sum(block_nbytes(j) for j, cs in shrink.items() if cs)
            if not part or part <= cap // 2 and cost[worst] - part > cap // 2:
                continue  # a whole tensor (an embedding table) is most of it: tiling the rest would not help
            if any(c in split for cs in shrink.values() for c in cs):
                continue  # shrinks this round already
            j = max((j for j, cs in shrink.items() if cs), key=block_nbytes)  # the largest tensor that shrinks,
            split.add(max(shrink[j], key=lambda c: -(-ir.ext[c] // blocks[c])))  # by its largest tile
        if not split:
            break
        for c in split:
            blocks[c] = min(ir.ext[c], blocks[c] * 2)
    return blocks


def emit(ir: IR, live: list[int], blocks: dict[int, int]) -> tuple[Graph, dict[str, np.ndarray], dict, str]:
    """The logical graph of the ``live`` records, the constant inputs' values by name, the tiles by letter and
    the letters of tiled classes in the order their blocks go round-robin over GPUs (weight classes first)."""
    upper = _letters(ir, live, {c: -(-ir.ext[c] // n) for c, n in blocks.items() if n > 1})
    tiles = {upper[c]: -(-ir.ext[c] // blocks[c]) for c in upper}

    def letters(dims) -> str:
        lower = iter(string.ascii_lowercase)
        return "".join(upper.get(ir.find(d)) or next(lower) for d in dims)

    g = Graph(dtype=ir.dtype)
    values = {}
    gid = {r: i for i, r in enumerate(live)}
    for i in live:
        r = ir.recs[i]
        dims, shape = letters(r.dims), ir.shape(i)
        if r.op == "input":
            g.input(r.name, dims, shape, dtype=r.dtype)
            if r.value is not None:
                values[r.name] = r.value.astype(NP_DTYPE[r.dtype], copy=False)
            continue
        p = dict(r.params)
        if r.op == "einsum":
            p = {"subscripts": _subscripts(ir, r, upper), "scale": float(p.get("scale", 1.0))}
        g._new(r.op, [gid[j] for j in r.inputs], dims, shape, p, r.name, dtype=r.dtype)
    g.outputs = [gid[r] for r in ir.outputs]
    weights = {upper.get(ir.find(d)) for i in live if ir.recs[i].value is not None for d in ir.recs[i].dims}
    order = "".join(sorted(tiles, key=lambda x: (x not in weights, x)))
    return g, values, tiles, order


def _letters(ir: IR, live: list[int], tile: dict[int, int]) -> dict[int, str]:
    """An upper-case letter per tiled class: classes of one tile size that never meet in a vertex (a record with
    its inputs) share one, as the decoder layers' own FFN classes do. Beyond 26 letters the rest stay whole."""
    meets: dict[int, set] = {c: set() for c in tile}
    for i in live:
        scope = {ir.find(d) for j in (i, *ir.recs[i].inputs) for d in ir.recs[j].dims} & tile.keys()
        for c in scope:
            meets[c] |= scope
    upper: dict[int, str] = {}
    holders: dict[str, list[int]] = {}
    for c in sorted(tile, key=lambda c: (-tile[c], c)):
        for x in string.ascii_uppercase:
            cs = holders.setdefault(x, [])
            if not cs or tile[cs[0]] == tile[c] and not any(o in meets[c] for o in cs):
                cs.append(c)
                upper[c] = x
                break
    return upper


def _subscripts(ir: IR, r: Rec, upper: dict) -> str:
    """Einsum subscripts of a contraction record: its ``idx`` (per operand, per memory axis, an index) and
    ``out`` (the output's indices), indices of tiled classes as their letters."""
    lower = iter(string.ascii_lowercase)
    names: dict[int, str] = {}
    operands = [ir.recs[j].dims for j in r.inputs]
    for dims, idx in zip([*operands, r.dims], [*r.params["idx"], r.params["out"]], strict=True):
        for d, i in zip(dims, idx, strict=True):
            if i not in names:
                names[i] = upper.get(ir.find(d)) or next(lower)
    a, b, o = ("".join(names[i] for i in idx) for idx in (*r.params["idx"], r.params["out"]))
    return f"{a},{b}->{o}"


class ImportLowering(_Lowering):
    """``turnip.graph``'s lowering plus the imported graphs' ops (``turnip.torchimport.kernels``) and attention
    without a causal mask."""

    def _ew(self, node):
        self._map(node)

    def _axis_whole(self, node, x=None):
        t = self.g.t(node.inputs[0]) if x is None else x
        self.whole(t, t.dims[int(node.params["axis"])], node.op)
        self._map(node)

    def _reduce(self, node):
        self._axis_whole(node)

    _layernorm = _softmax = _slice = _reduce

    def _cat(self, node):
        self._axis_whole(node, node.out)

    def _relayout(self, node):
        self._map(node)

    def _attention(self, node):
        """Placed by head block, never by token block (key ranges are shared by a head block's queries)."""
        base = self.T
        self.T = dataclasses.replace(base, parallel=base.parallel.replace(node.out.dims[0], ""))
        try:
            if node.params.get("causal", True):
                lower_attention(self, node)
            else:
                self._bidirectional(node)
        finally:
            self.T = base

    def _bidirectional(self, node):
        T, b = self.T, self.b
        q, k, v = node.inputs
        t, kt = node.out, self.g.t(k)
        tl, hl, kl = t.dims[0], t.dims[1], kt.dims[0]
        for letter in t.dims[2:]:
            self.whole(t, letter, "attention")
        nk = T.nblocks(kl, kt.shape[0])
        ranges: dict = {}
        blocks = {}
        for idx in self.grid(t):
            coords = {tl: idx[0], hl: idx[1]}
            gpu = T.place(coords)
            kv = []
            for x in (k, v):
                key = (x, idx[1], gpu)
                if key not in ranges:
                    parts = [self.block(x, {kl: j, hl: idx[1]}, gpu) for j in range(nk)]
                    shape = (sum(b.shape_of(p)[0] for p in parts), *b.shape_of(parts[0])[1:])
                    name = f"{self.g.t(x).name}[:,{idx[1]}]"
                    ranges[key] = parts[0] if nk == 1 else b.kernel("concat", parts, shape, t.dtype, gpu, {}, name=name)
                kv.append(ranges[key])
            p = {"scale": node.params["scale"], "causal": False, "q_off": 0, "k_off": 0}
            qv = self.block(q, coords, gpu)
            blocks[idx] = b.kernel("sdpa", [qv, *kv], self.bshape(t, idx), t.dtype, gpu, p, name=f"{t.name}{list(idx)}")
        self.blocks[t.id] = blocks


def lower_imported(g: Graph, tiling: Tiling) -> TaskGraph:
    tg = ImportLowering(g, tiling).run()
    tg.validate()
    return tg
