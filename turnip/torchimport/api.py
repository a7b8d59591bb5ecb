"""``from_torch``: a PyTorch module and example inputs to a verified-ready plan, through ``torch.export``.

The exported program's aten graph is lowered to turnip's tensor IR (``turnip.torchimport.trace``), tiled
automatically from the budget and GPU count (``turnip.torchimport.ir.choose_tiles``), lowered to a taskgraph
and planned by BuildMemgraph under the budget like any builder's graph. Parameters and buffers are graph
inputs whose values come from the module's state dict; ``Imported.run`` writes them and the call's inputs,
runs the plan and gives the outputs back in torch's shapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from turnip.graph import Tiling
from turnip.torchimport.ir import choose_tiles, emit, lower_imported
from turnip.torchimport.patterns import fuse, live


@dataclass
class Imported:
    """A compiled imported program: taskgraph ``tg``, memgraph ``mg``, the constant inputs' values by graph
    input name, the user inputs (name and the graph input's shape, in call order; None where unused) and the
    outputs (a graph output's name and how its blocks become the torch tensor, or a constant)."""

    tg: object
    mg: object
    values: dict[str, np.ndarray]
    inputs: list[tuple[str, tuple[int, ...] | None]]
    outputs: list[dict]
    stats: dict = field(default_factory=dict)
    gathers: dict = field(default_factory=dict)  # graph input -> (user input name, table): rows gathered on the host

    def verify(self) -> list:
        from turnip.memgraph.verify import verify

        return verify(self.mg, self.tg)

    def input_blocks(self, *args) -> dict[int, np.ndarray]:
        """Every taskgraph input's block from the constants and the call's arguments (torch tensors or arrays)."""
        from turnip.memgraph.interp import NP_DTYPE

        full = dict(self.values)
        given = {}
        for (name, shape), a in zip(self.inputs, args, strict=True):
            given[name] = np.asarray(a.detach().cpu().numpy() if hasattr(a, "detach") else a)
            if shape is not None:
                full[name] = given[name].reshape(shape)
        for name, (src, table) in self.gathers.items():
            shape = self.tg.meta["input_blocks"][name][0]
            full[name] = table[given[src].reshape(-1).astype(np.int64)].reshape(shape)
        out = {}
        for name, (_shape, blocks) in self.tg.meta["input_blocks"].items():
            for starts, v in blocks:
                sl = tuple(slice(s, s + n) for s, n in zip(starts, self.tg.shape[v], strict=True))
                out[v] = np.ascontiguousarray(full[name][sl]).astype(NP_DTYPE[self.tg.dtype[v]], copy=False)
        return out

    def run(self, *args, backend: str = "cpu", policy: str = "nondet", streams_per_gpu: int = 3, seed: int = 0,
            **options) -> list[np.ndarray]:  # fmt: skip
        """Run the plan on ``args`` (as the example inputs); the outputs as numpy arrays of torch's shapes."""
        from turnip.memgraph.interp import assemble
        from turnip.runtime import execute, open_backend

        t0 = time.perf_counter()
        with open_backend(backend, self.mg, streams_per_gpu, **options) as be:
            be.write_inputs(self.input_blocks(*args))
            res = execute(self.mg, be, policy, streams_per_gpu, seed=seed)
            vals = be.read_outputs()
        self.stats["last_run_s"] = time.perf_counter() - t0
        self.stats["last_makespan_ns"] = res.makespan_ns
        return [o["value"] if "value" in o else to_torch_layout(assemble(self.tg, vals, o["name"]), o)
                for o in self.outputs]  # fmt: skip


def to_torch_layout(arr: np.ndarray, o: dict) -> np.ndarray:
    y = arr.transpose(o["perm"]).reshape(o["present"])
    return np.ascontiguousarray(np.broadcast_to(y.reshape(o["placed"]), o["full"]).reshape(o["shape"]))


def _layout(ir, v) -> dict:
    dims = ir.recs[v.rec].dims
    seq = [d for g in v.groups for d in g]
    phys = [d for d in seq if d in dims]
    rest = [d for d in dims if d not in phys]
    return {"name": ir.recs[v.rec].name, "perm": [dims.index(d) for d in phys + rest],
            "present": [ir.ext[d] for d in phys], "placed": [ir.ext[d] if d in dims else 1 for d in seq],
            "full": [ir.ext[d] for d in seq],
            "shape": [int(np.prod([ir.ext[d] for d in g])) for g in v.groups]}  # fmt: skip


def export(module, example_inputs):
    """``torch.export.export`` of ``module`` in eval mode on ``example_inputs`` (a tensor or a tuple)."""
    import torch

    args = tuple(example_inputs) if isinstance(example_inputs, tuple | list) else (example_inputs,)
    if hasattr(module, "eval"):
        module = module.eval()
    with torch.no_grad():
        return torch.export.export(module, args), args


def from_torch(module, example_inputs, budget: int | str = "6GiB", gpus: int = 1, dtype: str = "fp32",
               resident="0", config=None, name: str = "", fuse_ops: bool = True, fold: bool | None = None,
               ) -> Imported:  # fmt: skip
    """Compile ``module`` (a ``torch.nn.Module``) for ``example_inputs`` under ``budget`` bytes per GPU on
    ``gpus`` GPUs, computing in ``dtype`` (fp32, fp16, bf16). Ops with no lowering are refused in one
    ``UnsupportedOps`` naming each with its count; a budget too small for some vertex raises ``BudgetError``.
    ``fuse_ops``: chains that are one of turnip's fused ops become it (``turnip.torchimport.patterns``);
    ``fold``: sums folded into the einsums producing their terms, as the builder's (``turnip.compile.folded``;
    None: ``fold_adds_on()``)."""
    from turnip.compile import build_with_resident, folded, parse_nbytes
    from turnip.torchimport.trace import trace

    if dtype not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"dtype must be fp32, fp16 or bf16, got {dtype!r}")
    if not 1 <= gpus <= 8:
        raise ValueError(f"gpus must be in 1..8, got {gpus}")
    b = parse_nbytes(budget) if isinstance(budget, str) else int(budget)
    t0 = time.perf_counter()
    ep, args = export(module, example_inputs)
    t1 = time.perf_counter()
    ir, user, outs, ctx = trace(ep, args, dtype)
    fused = fuse(ir) if fuse_ops else {}
    keep = live(ir)
    blocks = choose_tiles(ir, keep, b, gpus)
    g, values, tiles, order = emit(ir, keep, blocks)
    tg = lower_imported(g, Tiling(tiles, n_gpus=gpus, parallel=order))
    tg = folded(tg, fold)
    tg.meta.update(model=name or f"torch:{type(module).__name__}", dtype=dtype, n_gpus=gpus, source="torch.export")
    t2 = time.perf_counter()
    mg = build_with_resident(tg, b, config, resident)
    placed = {ir.recs[r].name: r for r in keep if ir.recs[r].op == "input"}
    inputs = [(u.name, ir.shape(placed[u.name]) if u.name in placed else None) for u in user]
    outputs = [_layout(ir, o) if hasattr(o, "rec") else {"value": np.asarray(o)} for o in outs]
    stats = {"export_s": t1 - t0, "lower_s": t2 - t1, "build_s": time.perf_counter() - t2, "tiles": tiles,
             "ir_records": len(ir.recs), "fused": fused}  # fmt: skip
    return Imported(tg, mg, values, inputs, outputs, stats, ctx.gathers)
