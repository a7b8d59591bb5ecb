"""A small tensor-level IR and the tiling/placement pass that lowers it to a TaskGraph.

Every logical tensor names its dimensions with single letters (``"td"``: tokens × hidden); a tile size per
letter splits each tensor into a grid of blocks, and einsum subscripts use the same letters. Lowering rules:
  einsum       one kernel per (output block × contracted block); more than one contracted block gives
               partials combined by ``sum_into`` vertices (one lock group per output block)
  elementwise  one kernel per output block; inputs are projected onto their own letters (broadcasting)
  row ops      (rmsnorm, rotary, embed) need their reduced letter in one block
  attention    causal, one fused ``sdpa`` vertex per (query block, head block, key range): key blocks
               concatenated into ranges of ``tiles["kv"]`` tokens (default all), only keys up to the
               query block's end; several ranges give partials (output + log-sum-exp) merged by
               ``attn_combine``. No score matrix is materialised.
Placement (tensor split): a block goes to GPU ``coord[l] % n_gpus`` for the first letter ``l`` of ``parallel``
present in its iteration space. Layers split (``parallel="layers"``): every block of a node goes to the stage
GPU of the node's decoder layer (``Node.layer``, set by ``Graph.layer_scope``). A consumer on another GPU
reads through a (shared) transfer vertex.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from turnip.graph_lower import TilingError
from turnip.taskgraph import Builder, TaskGraph

ELEMENTWISE = {"add_n", "mul", "scale", "silu", "silu_mul", "silu_mul_dg", "gelu_tanh_mul", "softcap", "cast", "adam_m",
               "adam_v", "adam_p"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Tensor:
    id: int
    dims: str
    shape: tuple[int, ...]
    dtype: str
    name: str


@dataclass(slots=True)
class Node:
    op: str
    inputs: tuple[int, ...]
    out: Tensor
    params: dict
    layer: int | None = None  # decoder layer (-1: before the first, L: after the last); None: not a model's


@dataclass
class Graph:
    """Logical computation: ``tensors[i]`` is produced by ``nodes[i]`` (``op == "input"`` for inputs). Nodes
    created inside ``layer_scope(i)`` belong to decoder layer ``i`` (the layers split places by it)."""

    dtype: str = "fp16"
    nodes: list[Node] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    layer: int | None = None  # the layer of nodes created now (``layer_scope``)

    def _new(self, op, inputs, dims, shape, params=None, name="", dtype=None) -> int:
        t = Tensor(len(self.nodes), dims, tuple(shape), dtype or self.dtype, name or f"{op}{len(self.nodes)}")
        self.nodes.append(Node(op, tuple(inputs), t, dict(params or {}), self.layer))
        return t.id

    @contextlib.contextmanager
    def layer_scope(self, layer: int | None):
        """Nodes created inside belong to decoder ``layer`` (-1: before the first layer, L: after the last)."""
        was, self.layer = self.layer, layer
        try:
            yield
        finally:
            self.layer = was

    def t(self, i: int) -> Tensor:
        return self.nodes[i].out

    def input(self, name: str, dims: str, shape, dtype: str | None = None) -> int:
        if len(dims) != len(shape):
            raise TilingError(f"input {name}: dims {dims!r} do not match shape {tuple(shape)}")
        return self._new("input", (), dims, shape, name=name, dtype=dtype)

    def einsum(self, subscripts: str, a: int, b: int, scale: float = 1.0, name: str = "") -> int:
        ins, out = subscripts.split("->")
        la, lb = ins.split(",")
        ext = {}
        for letters, t in ((la, self.t(a)), (lb, self.t(b))):
            if letters != t.dims:
                raise TilingError(f"einsum {subscripts}: operand {t.name} has dims {t.dims!r}, not {letters!r}")
            for l, s in zip(letters, t.shape, strict=True):
                if ext.setdefault(l, s) != s:
                    raise TilingError(f"einsum {subscripts}: dim {l} is {ext[l]} and {s}")
        return self._new("einsum", (a, b), out, [ext[l] for l in out], {"subscripts": subscripts, "scale": scale}, name)

    def map(self, op: str, *xs: int, name: str = "", **params) -> int:
        """Elementwise op; the output takes the dims of the widest input (the others broadcast) and the dtype
        of the first."""
        full = max((self.t(x) for x in xs), key=lambda t: len(t.dims))
        for x in xs:
            t = self.t(x)
            if any(full.shape[full.dims.index(l)] != s for l, s in zip(t.dims, t.shape, strict=True)):
                raise TilingError(f"{op}: {t.name}{t.shape} does not broadcast to {full.name}{full.shape}")
        return self._new(op, xs, full.dims, full.shape, params, name, dtype=self.t(xs[0]).dtype)

    def rmsnorm(self, x: int, w: int, eps: float = 1e-5, name: str = "", offset: float = 0.0) -> int:
        """RMSNorm over the last dim with weights ``offset + w``."""
        t = self.t(x)
        p = {"eps": eps} | ({"offset": offset} if offset else {})
        return self._new("rmsnorm", (x, w), t.dims, t.shape, p, name)

    def rotary(self, x: int, theta: float = 10000.0, name: str = "", seq: int | None = None, **scaling) -> int:
        """Rotary embedding over the last dim (frequency params: ``turnip.reference.rope_inv_freq``); with
        ``seq``, the token dim holds sequences of ``seq`` tokens one after another (a batch) and positions
        restart at each."""
        t = self.t(x)
        return self._new("rotary", (x,), t.dims, t.shape, {"theta": theta, **scaling} | _seq(seq), name)

    def rmsnorm_bwd(self, x: int, w: int, dy: int, eps: float = 1e-5, name: str = "") -> int:
        t = self.t(x)
        return self._new("rmsnorm_bwd", (x, w, dy), t.dims, t.shape, {"eps": eps}, name)

    def cast(self, x: int, dtype: str, alpha: float = 1.0, name: str = "") -> int:
        """``alpha * x`` in ``dtype``."""
        t = self.t(x)
        p = {"dtype": dtype, "src": t.dtype, "alpha": float(alpha)}
        return self._new("cast", (x,), t.dims, t.shape, p, name, dtype=dtype)

    def xent(self, logits: int, targets: int, name: str = "") -> int:
        """Cross-entropy per row of ``logits`` (tokens, vocabulary) against int32 ``targets`` (float32; 0
        where the target is negative)."""
        t = self._loss_operands(logits, targets)
        return self._new("xent", (logits, targets), t.dims[:1], t.shape[:1], {"src": t.dtype}, name, dtype="fp32")

    def xent_bwd(self, logits: int, targets: int, scale: float = 1.0, name: str = "") -> int:
        """d logits of the summed ``xent`` times ``scale``."""
        t = self._loss_operands(logits, targets)
        return self._new("xent_bwd", (logits, targets), t.dims, t.shape, {"scale": float(scale)}, name)

    def _loss_operands(self, logits: int, targets: int) -> Tensor:
        """The logits tensor, after checking that ``targets`` has one entry per row of it."""
        t, tg = self.t(logits), self.t(targets)
        if len(t.dims) != 2 or tg.dims != t.dims[:1] or tg.shape != t.shape[:1]:
            raise TilingError(f"xent: logits {t.name} {t.dims!r}{t.shape} and targets {tg.name} {tg.dims!r}{tg.shape}")
        return t

    def attention_bwd(self, q: int, k: int, v: int, o: int, do: int, seq: int | None = None, name: str = "") -> int:
        """Gradients of ``attention(q, k, v)`` (output ``o``) given ``do``, packed per token and key-value head
        as (dq of the group's query heads, dk, dv): dims q.dims[:2] + ``p``; take them out with ``cols``."""
        t, tk = self.t(q), self.t(k)
        r = t.shape[2] if len(t.shape) == 4 else 1
        p = {"scale": 1.0 / math.sqrt(t.shape[-1])} | _seq(seq)
        shape = (t.shape[0], tk.shape[1], (r + 2) * t.shape[-1])
        return self._new("attention_bwd", (q, k, v, o, do), t.dims[:2] + "p", shape, p, name)

    def cols(self, x: int, start: int, stop: int, dims: str, shape, name: str = "") -> int:
        """``x[..., start:stop]`` with the last dim reshaped: the result has ``dims``/``shape``, whose leading
        dims are those of ``x`` but its last."""
        t = self.t(x)
        k = len(t.dims) - 1
        if dims[:k] != t.dims[:k] or tuple(shape[:k]) != t.shape[:k] or math.prod(shape[k:]) != stop - start:
            raise TilingError(f"cols [{start}, {stop}) of {t.name} {t.dims!r}{t.shape} as {dims!r}{tuple(shape)}")
        p = {"start": start, "stop": stop, "tail": list(shape[k:])}
        return self._new("cols", (x,), dims, shape, p, name)

    def rows(self, x: int, start: int, stop: int, name: str = "") -> int:
        """Rows ``[start, stop)`` of ``x`` along its first dim (they must lie in one tile); the new first dim
        is ``s`` (never tiled)."""
        t = self.t(x)
        if not 0 <= start < stop <= t.shape[0]:
            raise TilingError(f"rows [{start}, {stop}) of {t.name}{t.shape}")
        if "s" in t.dims:
            raise TilingError(f"rows of {t.name}: its dims {t.dims!r} already use the letter 's'")
        return self._new("rows", (x,), "s" + t.dims[1:], (stop - start, *t.shape[1:]), {"start": start, "stop": stop},
                         name)  # fmt: skip

    def embed(self, ids: int, table: int, name: str = "") -> int:
        n, (_, d) = self.t(ids).shape[0], self.t(table).shape
        dims = self.t(ids).dims + self.t(table).dims[1]
        return self._new("embed", (ids, table), dims, (n, d), name=name, dtype=self.t(table).dtype)

    def attention(self, q: int, k: int, v: int, name: str = "", seq: int | None = None, scale: float = 0.0,
                  window: int = 0, softcap: float = 0.0) -> int:  # fmt: skip
        """Causal softmax(scale q k^T) v over q (tokens, heads, head dim) or, grouped-query,
        (tokens, key-value heads, group, head dim), and k, v (tokens, key-value heads, head dim); ``scale``
        0: 1 / sqrt(head dim). With ``seq``, the tokens are sequences of ``seq`` tokens one after another (a
        batch), each attending only to itself; ``window`` > 0: a query sees only the ``window`` latest keys
        (itself included); ``softcap`` > 0: scores capped to softcap tanh(s / softcap) before the softmax."""
        t, tk = self.t(q), self.t(k)
        if len(tk.dims) != 3 or t.dims[:2] != tk.dims[:2] or t.dims[-1] != tk.dims[-1] or len(t.dims) not in (3, 4):
            raise TilingError(f"attention: q {t.name} dims {t.dims!r} and k {tk.name} dims {tk.dims!r} do not match")
        if window < 0 or softcap < 0:
            raise TilingError(f"attention {name}: window {window} and softcap {softcap} must be >= 0")
        p = {"scale": float(scale) or 1.0 / math.sqrt(t.shape[-1])} | _seq(seq)
        p |= ({"window": int(window)} if window else {}) | ({"softcap": float(softcap)} if softcap else {})
        return self._new("attention", (q, k, v), t.dims, t.shape, p, name)


def _seq(seq: int | None) -> dict:
    return {} if seq is None else {"seq": int(seq)}


@dataclass(frozen=True)
class Tiling:
    """Tile sizes and placement. ``parallel``: letters whose blocks go round-robin over GPUs (the tensor
    split), or ``"layers"`` (the layers split): every block of a node goes to its layer's stage GPU,
    ``stage(layer)``, with decoder layer i of ``n_layers`` on GPU floor(i * n_gpus / n_layers).
    ``replicate``: names of logical inputs that every GPU reading them loads from the host as an input of
    its own (a *replica*: the same name and block, another taskgraph input) instead of receiving a transfer
    from the GPU that holds the block (the data split: each GPU its share of the sequences, every GPU the
    frozen weights). ``snake``: blocks of the first ``parallel`` letter placed back and forth (0, 1, .., G - 1,
    G - 1, .., 0, ...) instead of round-robin: a prompt's token tiles, whose causal attention grows with the
    tile's position, balanced over the GPUs."""

    tiles: dict  # letter -> tile size (missing: whole dimension)
    n_gpus: int = 1
    parallel: str = "hft"
    n_layers: int = 0  # decoder layers of the layers split
    pin: int | None = None  # every block on this GPU (the layers split, per node)
    replicate: frozenset = frozenset()  # logical inputs loaded by each GPU that reads them
    snake: bool = False  # blocks of the first parallel letter go 0, 1, .., G-1, G-1, .., 0, 0, 1, ..
    home: int | None = None  # where blocks with no parallel letter go (None: GPU 0)
    spread: bool = False  # the data split: a decoder layer's blocks with no parallel letter on GPU layer % G

    def stage(self, layer: int) -> int:
        """The GPU of decoder ``layer`` under the layers split (before the first: GPU 0; after the last: the
        last stage's)."""
        L = self.n_layers
        return min(max(layer, 0), L - 1) * self.n_gpus // L

    def nblocks(self, letter: str, size: int) -> int:
        return -(-size // self.tiles.get(letter, size))

    def span(self, letter: str, size: int, b: int) -> tuple[int, int]:
        ts = self.tiles.get(letter, size)
        return b * ts, min(size, (b + 1) * ts)

    def place(self, coords: dict) -> int:
        if self.pin is not None:
            return self.pin
        for l in self.parallel:
            if l in coords:
                if self.snake:  # causal attention's work grows with the token block: pair early with late
                    r = coords[l] % (2 * self.n_gpus)
                    return r if r < self.n_gpus else 2 * self.n_gpus - 1 - r
                return coords[l] % self.n_gpus
        return self.home or 0


class _Lowering:
    def __init__(self, g: Graph, tiling: Tiling):
        self.g, self.T = g, tiling
        self.b = Builder(tiling.n_gpus)
        self.blocks: dict[int, dict[tuple, int]] = {}  # logical tensor -> block coords -> tg vertex
        self.moves: dict = {}
        self.replicas: dict[tuple, int] = {}  # (logical input, block coords, gpu) -> its replica input vertex

    def grid(self, t: Tensor):
        return itertools.product(*(range(self.T.nblocks(l, s)) for l, s in zip(t.dims, t.shape, strict=True)))

    def bshape(self, t: Tensor, idx: tuple) -> tuple:
        return tuple(b - a for a, b in (self.T.span(l, s, i) for l, s, i in zip(t.dims, t.shape, idx, strict=True)))

    def block(self, x: int, coords: dict, gpu: int) -> int:
        t = self.g.t(x)
        key = tuple(coords.get(l, 0) for l in t.dims)
        v = self.blocks[x][key]
        if t.name in self.T.replicate and self.b.gpu_of(v) != gpu:
            r = self.replicas.get((x, key, gpu))
            if r is None:
                r = self.replicas[x, key, gpu] = self.b.input(self.bshape(t, key), t.dtype, gpu,
                                                              name=f"{t.name}{list(key)}@gpu{gpu}")  # fmt: skip
            return r
        return self.b.to_gpu(v, gpu, self.moves)

    def whole(self, t: Tensor, letter: str, op: str):
        s = t.shape[t.dims.index(letter)]
        if self.T.nblocks(letter, s) != 1:
            raise TilingError(f"{op} on {t.name} needs dim {letter!r} in one tile (size {s}); raise its tile size")

    def run(self) -> TaskGraph:
        base = self.T
        if base.parallel == "layers" and base.n_layers < 1:
            raise TilingError("the layers split needs the number of decoder layers (Tiling.n_layers)")
        pinned = [dataclasses.replace(base, pin=g) for g in range(base.n_gpus)]
        homed = [dataclasses.replace(base, home=g) for g in range(base.n_gpus)]
        for node in self.g.nodes:
            if base.parallel == "layers":
                if node.layer is None:
                    raise TilingError(f"the layers split places nodes by their layer; {node.op} {node.out.name} "
                                      "has none (build it inside Graph.layer_scope)")  # fmt: skip
                self.T = pinned[base.stage(node.layer)]
            elif base.spread:
                L = node.layer
                self.T = homed[L % base.n_gpus] if L is not None and 0 <= L else base
            getattr(self, "_" + ("map" if node.op in ELEMENTWISE else node.op))(node)
        self.T = base
        outs = [v for x in self.g.outputs for v in self.blocks[x].values()]
        ins = [n.out.id for n in self.g.nodes if n.op == "input"]
        return self.b.build(
            outputs=outs,
            meta={
                "tiles": dict(self.T.tiles),
                "output_blocks": self.block_map(self.g.outputs),
                "input_blocks": self.block_map(ins),
            },
        )

    def block_map(self, xs) -> dict:
        """logical tensor name -> (shape, [(block start per dim, taskgraph vertex)]); an input's replicas are
        blocks too (the same starts as the block they copy, on another GPU): writers fill each."""
        out = {
            self.g.t(x).name: (self.g.t(x).shape, [(self.starts(self.g.t(x), i), v) for i, v in self.blocks[x].items()])
            for x in xs
        }
        xs = set(xs)
        for (x, key, _gpu), r in self.replicas.items():
            if x in xs:
                out[self.g.t(x).name][1].append((self.starts(self.g.t(x), key), r))
        return out

    def starts(self, t: Tensor, idx: tuple) -> tuple:
        return tuple(self.T.span(l, s, i)[0] for l, s, i in zip(t.dims, t.shape, idx, strict=True))

    def _input(self, node: Node):
        t = node.out
        self.blocks[t.id] = {
            idx: self.b.input(
                self.bshape(t, idx),
                t.dtype,
                self.T.place(dict(zip(t.dims, idx, strict=True))),
                name=f"{t.name}{list(idx)}",
            )
            for idx in self.grid(t)
        }

    def _emit(self, node, idx, op, args_of, params=None):
        t = node.out
        coords = dict(zip(t.dims, idx, strict=True))
        gpu = self.T.place(coords)
        shape = self.bshape(t, idx)
        args = [self.block(x, coords, gpu) for x in args_of]
        p = params if params is not None else node.params
        return self.b.kernel(op, args, shape, t.dtype, gpu, p, name=f"{t.name}{list(idx)}")

    def _map(self, node: Node):
        self.blocks[node.out.id] = {idx: self._emit(node, idx, node.op, node.inputs) for idx in self.grid(node.out)}

    def _rmsnorm(self, node: Node):
        self.whole(node.out, node.out.dims[-1], "rmsnorm")
        self.blocks[node.out.id] = {
            idx: self._emit(node, idx, "rmsnorm", node.inputs) for idx in self.grid(node.out)
        }

    def seq_of(self, node: Node) -> int:
        """Tokens per sequence of a batched op (the whole token dim without ``seq``); token tiles must not
        straddle sequences: a tile divides a sequence or holds whole sequences (packed: ``packs``)."""
        t = node.out
        n = t.shape[0]
        seq = int(node.params.get("seq", n))
        tile = self.T.tiles.get(t.dims[0], n)
        if n % seq or (seq % tile and seq < n and tile % seq):
            raise TilingError(f"{node.op} {t.name}: {n} tokens in sequences of {seq} need a token tile dividing "
                              f"{seq} or a multiple of it, not {tile}")  # fmt: skip
        return seq

    def packs(self, node: Node) -> int:
        """``seq`` where the op's token tiles hold several whole sequences (a param of its vertices:
        ``turnip.reference.packed``), else 0."""
        seq = self.seq_of(node)
        t = node.out
        return seq if min(self.T.tiles.get(t.dims[0], t.shape[0]), t.shape[0]) > seq else 0

    def _rmsnorm_bwd(self, node: Node):
        self.whole(node.out, node.out.dims[-1], "rmsnorm_bwd")
        self._map(node)

    def _xent(self, node: Node):
        self.whole(self.g.t(node.inputs[0]), self.g.t(node.inputs[0]).dims[1], node.op)
        self._map(node)

    _xent_bwd = _xent

    def _cols(self, node: Node):
        x, t = self.g.t(node.inputs[0]), node.out
        self.whole(x, x.dims[-1], "cols")
        for letter in t.dims[len(x.dims) - 1 :]:
            self.whole(t, letter, "cols")
        self._map(node)

    def _attention_bwd(self, node: Node):
        from turnip.graph_lower import lower_attention_bwd

        lower_attention_bwd(self, node)

    def _rotary(self, node: Node):
        t = node.out
        self.whole(t, t.dims[-1], "rotary")
        seq = self.seq_of(node)
        pack = {"seq": seq} if self.packs(node) else {}
        out = {}
        for idx in self.grid(t):
            p = {k: v for k, v in node.params.items() if k != "seq"}
            p["pos_off"] = self.T.span(t.dims[0], t.shape[0], idx[0])[0] % seq
            out[idx] = self._emit(node, idx, "rotary", node.inputs, p | pack)
        self.blocks[t.id] = out

    def _rows(self, node: Node):
        """One ``rows`` kernel on the GPU of the token tile holding the rows (later readers fetch the few
        rows, not the tile)."""
        x, t = self.g.t(node.inputs[0]), node.out
        a, b = node.params["start"], node.params["stop"]
        tl, n = x.dims[0], x.shape[0]
        bi = a // self.T.tiles.get(tl, n)
        lo, hi = self.T.span(tl, n, bi)
        if b > hi:
            raise TilingError(f"rows [{a}, {b}) of {x.name} cross its {tl} tiles; take them from one tile")
        out = {}
        for idx in self.grid(t):
            coords = dict(zip(x.dims[1:], idx[1:], strict=True)) | {tl: bi}
            gpu = self.T.place(coords)
            src = self.block(x.id, coords, gpu)
            shape = (b - a, *self.bshape(t, idx)[1:])
            p = {"start": a - lo, "stop": b - lo}
            out[idx] = self.b.kernel("rows", [src], shape, t.dtype, gpu, p, name=f"{t.name}{list(idx)}")
        self.blocks[t.id] = out

    def _embed(self, node: Node):
        self.whole(self.g.t(node.inputs[1]), self.g.t(node.inputs[1]).dims[0], "embed")
        self.whole(node.out, node.out.dims[1], "embed")
        self.blocks[node.out.id] = {
            idx: self._emit(node, idx, "embed", node.inputs) for idx in self.grid(node.out)
        }

    def _einsum(self, node: Node):
        from turnip.graph_lower import lower_einsum

        lower_einsum(self, node)

    def _attention(self, node: Node):
        from turnip.graph_lower import lower_attention

        lower_attention(self, node)


def lower(g: Graph, tiling: Tiling) -> TaskGraph:
    """Tile and place a logical graph; the result is validated."""
    tg = _Lowering(g, tiling).run()
    tg.validate()
    return tg
