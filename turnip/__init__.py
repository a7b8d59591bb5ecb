"""turnip: compile GPU computations larger than GPU memory into memgraphs with CPU RAM offload, then run
them (real GPUs, CPU) or simulate them, with one scheduler core. Importable with numpy alone."""

__version__ = "0.1.0"
