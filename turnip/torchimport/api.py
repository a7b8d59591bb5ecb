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

    def _per_call(self) -> set[str]:
        """Graph inputs whose values come from a call's arguments (the user inputs and the rows gathered for them)."""
        return {name for name, shape in self.inputs if shape is not None} | set(self.gathers)

    def constant_blocks(self) -> dict[int, np.ndarray]:
        """The taskgraph input blocks of the constants (parameters, buffers, folded tensors): the same every call."""
        return self._blocks(self.values, exclude=self._per_call())

    def call_blocks(self, *args) -> dict[int, np.ndarray]:
        """The taskgraph input blocks that come from the call's arguments (torch tensors or arrays, as the example
        inputs)."""
        if len(args) != len(self.inputs):
            raise TypeError(f"the program takes {len(self.inputs)} input(s) (as its example inputs), got {len(args)}")
        full, given = {}, {}
        for (name, shape), a in zip(self.inputs, args, strict=True):
            given[name] = np.asarray(a.detach().cpu().numpy() if hasattr(a, "detach") else a)
            if shape is not None:
                if given[name].size != int(np.prod(shape)):
                    raise ValueError(f"input {name!r}: {given[name].shape} has not the example's "
                                     f"{int(np.prod(shape))} elements (a plan is compiled for one shape)")  # fmt: skip
                full[name] = given[name].reshape(shape)
        for name, (src, table) in self.gathers.items():
            shape = self.tg.meta["input_blocks"][name][0]
            full[name] = table[given[src].reshape(-1).astype(np.int64)].reshape(shape)
        return self._blocks(full, only=self._per_call())

    def _blocks(self, full: dict, exclude=(), only=None) -> dict[int, np.ndarray]:
        from turnip.memgraph.interp import NP_DTYPE

        out = {}
        for name, (_shape, blocks) in self.tg.meta["input_blocks"].items():
            if name in exclude or (only is not None and name not in only):
                continue
            for starts, v in blocks:
                sl = tuple(slice(s, s + n) for s, n in zip(starts, self.tg.shape[v], strict=True))
                out[v] = np.ascontiguousarray(full[name][sl]).astype(NP_DTYPE[self.tg.dtype[v]], copy=False)
        return out

    def outputs_of(self, vals: dict) -> list[np.ndarray]:
        """The outputs in torch's shapes from a backend's output tensors."""
        from turnip.memgraph.interp import assemble

        return [o["value"] if "value" in o else to_torch_layout(assemble(self.tg, vals, o["name"]), o)
                for o in self.outputs]  # fmt: skip

    def run(self, *args, backend: str = "cpu", policy: str = "nondet", streams_per_gpu: int = 3, seed: int = 0,
            **options) -> list[np.ndarray]:  # fmt: skip
        """Run the plan once on ``args`` (as the example inputs); the outputs as numpy arrays of torch's shapes.
        Loads the plan and writes every constant for this one call: for several calls, ``session``."""
        with self.session(backend, policy, streams_per_gpu, **options) as s:
            out = s(*args, seed=seed)
        self.stats["last_run_s"] = s.stats["open_s"] + s.stats["last_call_s"]
        self.stats["last_makespan_ns"] = s.stats["last_makespan_ns"]
        return out

    def session(self, backend: str = "cpu", policy: str = "nondet", streams_per_gpu: int = 3,
                **options) -> Session:  # fmt: skip
        """The plan loaded on ``backend`` with its constants written (and the resident ones on the GPUs) once;
        each call of the session writes only the call's inputs, runs and reads the outputs. Close it (or use it
        as a context manager) to free the GPU and pinned memory."""
        return Session(self, backend, policy, streams_per_gpu, options)


class Session:
    """An ``Imported`` program loaded on a backend: ``session(*args)`` runs it on new inputs (the constants stay
    written, resident ones on the GPUs). ``stats``: ``open_s`` (loading the plan and writing the constants),
    ``last_call_s`` (the last call: inputs written, run, outputs read), ``last_makespan_ns`` (its run),
    ``last_phases_s`` (that call's seconds writing the inputs, running, reading and assembling the outputs)."""

    def __init__(self, imp: Imported, backend: str, policy: str, streams_per_gpu: int, options: dict):
        from turnip.runtime import open_backend

        t0 = time.perf_counter()
        self.imp, self.policy, self.streams = imp, policy, streams_per_gpu
        self.be = open_backend(backend, imp.mg, streams_per_gpu, **options)
        try:
            self.be.write_inputs(imp.constant_blocks())
        except BaseException:
            self.be.close()
            raise
        self.last = None  # the last run's RunResult (``trace``)
        self.stats = {"open_s": time.perf_counter() - t0, "calls": 0}

    def __call__(self, *args, seed: int = 0) -> list[np.ndarray]:
        from turnip.runtime import execute

        if self.be is None:
            raise RuntimeError("the session is closed")
        t = [time.perf_counter()]
        self.be.write_inputs(self.imp.call_blocks(*args))
        t.append(time.perf_counter())
        self.last = execute(self.imp.mg, self.be, self.policy, self.streams, seed=seed)
        t.append(time.perf_counter())
        vals = self.be.read_outputs(views=True)  # assembled (copied) below, before the next run
        t.append(time.perf_counter())
        out = self.imp.outputs_of(vals)
        t.append(time.perf_counter())
        phases = dict(zip(("write", "run", "read", "assemble"), np.diff(t).tolist(), strict=True))
        self.stats.update(last_call_s=t[-1] - t[0], last_makespan_ns=self.last.makespan_ns,
                          calls=self.stats["calls"] + 1, last_phases_s=phases)  # fmt: skip
        return out

    def close(self) -> None:
        if self.be is not None:
            self.be.close()
            self.be = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
               resident="auto", config=None, name: str = "", fuse_ops: bool = True, fold: bool | None = None,
               ) -> Imported:  # fmt: skip
    """Compile ``module`` (a ``torch.nn.Module``) for ``example_inputs`` under ``budget`` bytes per GPU on
    ``gpus`` GPUs, computing in ``dtype`` (fp32, fp16, bf16). Ops with no lowering are refused in one
    ``UnsupportedOps`` naming each with its count; a budget too small for some vertex raises ``BudgetError``.
    ``resident``: input bytes per GPU kept on the GPUs across runs (``turnip.compile.build_with_resident``;
    ``"auto"``: a quarter of the budget where that moves fewer bytes per run; ``"0"``: every input streams).
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
