"""Walk an exported program's aten graph and build importer records (``turnip.torchimport.ir``).

Every node is folded (all its inputs constant: run by torch on the host, as position ids, masks and rotary
tables are), lowered by a rule of ``turnip.torchimport.rules``, or listed as unsupported; the walk goes on
past an unsupported node (what depends on it is skipped) so that one refusal lists every op that has no
lowering, with its count.
"""

from __future__ import annotations

import operator
from collections import Counter

from turnip.torchimport.ir import IR
from turnip.torchimport.values import TV, Inp, Lin, Unsupported


class UnsupportedOps(ValueError):
    """Ops of an exported program with no lowering: ``ops`` maps 'aten.op (why)' to its count."""

    def __init__(self, ops: Counter):
        self.ops = ops
        listed = ", ".join(f"{k} x{n}" for k, n in ops.most_common())
        super().__init__(f"cannot import the program: {sum(ops.values())} op(s) have no lowering: {listed}")


class _Poison:
    pass


POISON = _Poison()
IGNORED = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range", "_assert_async",
           "sym_constrain_range_for_size")  # fmt: skip


def op_name(target) -> str:
    """``add`` for ``aten.add.Tensor`` (overloads share a rule), ``getitem`` for ``operator.getitem``."""
    if target is operator.getitem:
        return "getitem"
    if hasattr(target, "_schema"):
        return target._schema.name.split("::")[-1]
    return str(getattr(target, "__name__", target)).split(".")[0]


def _torch():
    import torch

    return torch


def _map_args(a, f):
    if isinstance(a, list | tuple):
        return type(a)(_map_args(x, f) for x in a)
    if isinstance(a, dict):
        return {k: _map_args(v, f) for k, v in a.items()}
    return f(a)


def _leaves(a):
    if isinstance(a, list | tuple):
        for x in a:
            yield from _leaves(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from _leaves(x)
    else:
        yield a


def trace(ep, example_inputs, dtype: str = "fp32"):
    """Importer records of exported program ``ep``: (IR, user inputs in order as ``Inp``, outputs as values
    (``TV`` or constant tensors)). ``UnsupportedOps`` lists what has no lowering."""
    from turnip.torchimport import rules, table

    torch = _torch()
    ir = IR(dtype=dtype)
    sig = ep.graph_signature
    state = dict(ep.state_dict)
    consts = dict(getattr(ep, "constants", {}) or {})
    env: dict = {}
    user = []
    ctx = rules.Context(ir)
    flat_inputs = [x for x in _leaves(example_inputs)]
    spec_inputs = [s for s in sig.input_specs]
    k = 0
    for node, spec in zip([n for n in ep.graph.nodes if n.op == "placeholder"], spec_inputs, strict=True):
        kind = spec.kind.name
        if kind in ("PARAMETER", "BUFFER"):
            env[node] = state[spec.target].detach() if spec.target in state else consts[spec.target]
            ctx.names[id(env[node])] = spec.target
        elif kind == "CONSTANT_TENSOR":
            env[node] = consts[spec.target]
        elif kind == "USER_INPUT":
            x = flat_inputs[k] if k < len(flat_inputs) else None
            k += 1
            if isinstance(x, torch.Tensor):
                inp = Inp(node.name, tuple(x.shape), not x.is_floating_point())
                env[node] = inp
                user.append(inp)
            else:
                env[node] = x
        else:
            raise UnsupportedOps(Counter({f"an input of kind {kind}": 1}))
    bad: Counter = Counter()
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node.target)
        if name in IGNORED:
            continue
        args = _map_args(node.args, lambda a: env.get(a, a) if _is_node(a) else a)
        kwargs = _map_args(dict(node.kwargs), lambda a: env.get(a, a) if _is_node(a) else a)
        leaves = [x for x in _leaves((args, kwargs))]
        if any(x is POISON for x in leaves):
            env[node] = POISON
            continue
        if not any(isinstance(x, TV | Lin | Inp) for x in leaves):
            try:
                env[node] = node.target(*args, **kwargs)  # constant folding, on the host
                continue
            except Exception as e:  # noqa: BLE001 - named in the refusal
                bad[f"aten.{name} (folding failed: {type(e).__name__})"] += 1
                env[node] = POISON
                continue
        rule = table.RULES.get(name)
        if rule is None:
            bad[f"aten.{name}"] += 1
            env[node] = _stand_in(node)
            continue
        try:
            env[node] = rule(ctx, *args, **kwargs)
        except Unsupported as e:
            bad[f"aten.{name} ({e})"] += 1
            env[node] = _stand_in(node)
    if bad:
        raise UnsupportedOps(bad)
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    outs = [env[a] if _is_node(a) else a for a in _leaves(out_node.args[0])]
    values = []
    for o in outs:
        if isinstance(o, TV | Lin | Inp):
            try:
                v = ctx.force(o)
            except Unsupported as e:
                raise UnsupportedOps(Counter({f"an output ({e})": 1})) from None
            if ir.recs[v.rec].op == "input":
                v = ctx.copy(v)
            ir.outputs.append(v.rec)
            values.append(v)
        else:
            values.append(o)
    return ir, user, values, ctx


def _stand_in(node):
    """An unsupported node's result as a new input of its shape, so that the ops after it are checked too."""
    val = node.meta.get("val")
    if hasattr(val, "shape"):
        return Inp(f"unsupported.{node.name}", tuple(int(s) for s in val.shape), not val.is_floating_point())
    if isinstance(val, list | tuple) and all(hasattr(v, "shape") for v in val):
        return type(val)(Inp(f"unsupported.{node.name}.{i}", tuple(int(s) for s in v.shape), not v.is_floating_point())
                         for i, v in enumerate(val))  # fmt: skip
    return POISON


def _is_node(a) -> bool:
    return type(a).__name__ == "Node"
