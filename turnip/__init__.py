"""turnip: compile GPU computations larger than GPU memory into memgraphs with CPU RAM offload, then run
them (real GPUs, CPU) or simulate them, with one scheduler core. Importable with numpy alone."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``turnip.generate(...)`` (``turnip.generation.generate``), imported on first use."""
    if name == "generate":
        from turnip.generation import generate

        return generate
    raise AttributeError(f"module 'turnip' has no attribute {name!r}")
