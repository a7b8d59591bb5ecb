"""turnip: compile GPU computations larger than GPU memory into memgraphs with CPU RAM offload, then run
them (real GPUs, CPU) or simulate them, with one scheduler core. Importable with numpy alone."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``turnip.generate(...)`` (``turnip.generation.generate``) and ``turnip.from_torch(...)``
    (``turnip.torchimport.api.from_torch``), imported on first use."""
    if name == "generate":
        from turnip.generation import generate

        return generate
    if name == "from_torch":
        from turnip.torchimport.api import from_torch

        return from_torch
    raise AttributeError(f"module 'turnip' has no attribute {name!r}")
