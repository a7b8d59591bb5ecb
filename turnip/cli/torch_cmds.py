"""``turnip compile --torch FILE.py:factory``: a PyTorch module exported and compiled (``turnip.from_torch``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from turnip.cli import CliError
from turnip.cli import args as ck

TORCH_HELP = ("compile a PyTorch module instead of --model: FILE.py:factory, where factory() returns (module, "
              "example_inputs); the program torch.export gives is lowered, tiled from --budget and --gpus "
              "and planned")  # fmt: skip


def load_factory(spec: str):
    """(module, example_inputs) from ``FILE.py:factory``; usage errors name what is missing."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise CliError(f"--torch {spec!r}: expected FILE.py:factory (a function returning (module, example_inputs))",
                       ck.USAGE)  # fmt: skip
    f = Path(path)
    if not f.is_file():
        raise CliError(f"--torch: {path}: no such file", ck.USAGE)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise CliError("--torch needs PyTorch: pip install torch (a CPU wheel is enough)", ck.FAILED) from None
    mod_spec = importlib.util.spec_from_file_location(f"turnip_factory_{f.stem}", f)
    mod = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(mod)
    except Exception as e:
        raise CliError(f"--torch: {path} failed to load: {type(e).__name__}: {e}", ck.USAGE) from e
    factory = getattr(mod, name, None)
    if not callable(factory):
        raise CliError(f"--torch: {path} has no function {name!r}", ck.USAGE)
    try:
        made = factory()
    except Exception as e:
        raise CliError(f"--torch: {name}() failed: {type(e).__name__}: {e}", ck.USAGE) from e
    if not isinstance(made, tuple) or len(made) != 2:
        raise CliError(f"--torch: {name}() must return (module, example_inputs), not {type(made).__name__}", ck.USAGE)
    return made


def compile_torch(a, config):
    """(taskgraph, memgraph) of ``turnip compile --torch``: the factory's module exported and compiled under
    ``--budget`` on ``--gpus`` in ``--dtype`` (``turnip.from_torch``); one error line for what fails."""
    from turnip.torchimport.api import from_torch
    from turnip.torchimport.trace import UnsupportedOps

    budget = ck.nbytes(a.budget, "--budget", minimum=1)
    ck.nbytes(a.resident, "--resident", auto=True)
    module, inputs = load_factory(a.torch)
    try:
        imp = from_torch(module, inputs, budget=budget, gpus=a.gpus, dtype=a.dtype, resident=a.resident,
                         config=config, name=f"torch:{Path(a.torch).name}")  # fmt: skip
    except UnsupportedOps as e:
        raise CliError(f"{e}; rewrite those ops or export a smaller part of the model", ck.FAILED) from None
    except Exception as e:
        if not type(e).__module__.startswith("torch"):
            raise
        raise CliError(f"torch.export could not export the module: {type(e).__name__}: {e}", ck.FAILED) from e
    return imp.tg, imp.mg
