"""GPU kernels (Numba CUDA, cuBLAS through CuPy) for every taskgraph op, with numpy references.

Never imports ``turnip``. ``reference`` needs numpy only; the kernels import numba lazily.
"""

from cuda_kernels._numba import apply_numpy_shim

apply_numpy_shim()  # before anything can make numba-cuda compile (numpy >= 2.5 lacks row_stack)
