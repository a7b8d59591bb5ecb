"""The lowering rule of every aten op the importer knows, by op name (overloads share a rule)."""

from __future__ import annotations

from turnip.torchimport import nn, views
from turnip.torchimport.rules import _binary, _gelu, _pow, _rsub, _unary

RULES = {
    "add": _binary("add"), "sub": _binary("sub"), "mul": _binary("mul"), "div": _binary("div"), "rsub": _rsub,
    "neg": _unary("neg"), "exp": _unary("exp"), "tanh": _unary("tanh"), "sqrt": _unary("sqrt"),
    "rsqrt": _unary("rsqrt"), "relu": _unary("relu"), "sigmoid": _unary("sigmoid"), "silu": _unary("silu"),
    "gelu": _gelu, "pow": _pow,
    "mean": nn._reduction("mean"), "sum": nn._reduction("sum"), "amax": nn._reduction("max"),
    "_softmax": nn.softmax, "softmax": nn.softmax, "layer_norm": nn.layer_norm,
    "linear": nn.linear, "addmm": nn.addmm, "mm": nn.mm, "matmul": nn.matmul, "bmm": nn.matmul,
    "embedding": nn.embedding, "conv2d": nn.conv2d, "scaled_dot_product_attention": nn.sdpa,
    "view": views.view, "reshape": views.view, "_unsafe_view": views.view, "flatten": views.flatten,
    "unflatten": views.unflatten, "unsqueeze": views.unsqueeze, "squeeze": views.squeeze,
    "permute": views.permute, "transpose": views.transpose, "t": views.t, "expand": views.expand,
    "slice": views.tslice, "select": views.select, "split": views.split,
    "split_with_sizes": views.split_with_sizes, "chunk": views.chunk, "cat": views.cat,
    "getitem": views.getitem,
    **dict.fromkeys(("clone", "contiguous", "alias", "detach", "dropout", "to", "_to_copy", "lift_fresh_copy",
                     "type_as", "view_as"), views.identity),
}  # fmt: skip
