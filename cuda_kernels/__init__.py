"""GPU kernels (Numba CUDA, cuBLAS through CuPy) for every taskgraph op, with numpy references.

Never imports ``turnip``. ``reference`` needs numpy only; the kernels import numba lazily.
"""
