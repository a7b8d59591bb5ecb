"""Real execution of compiled plans: the scheduler core (``turnip.sched``) driven by a thin loop over a
backend (``cpu``: numpy on byte arenas with real threads; ``cuda``: numba-cuda streams, device arenas,
pinned host memory). Importing this package needs numpy only; backends import their libraries lazily.

    from turnip.runtime import open_backend, execute
    with open_backend("cpu", mg) as be:
        be.write_inputs(inputs)                  # {taskgraph input tensor: array}
        res = execute(mg, be, policy="nondet")   # RunResult: times per vertex, .trace(mg), .row(mg)
        outs = be.read_outputs()                 # {output tensor: array}
"""

from __future__ import annotations

from turnip.runtime.driver import RunResult, execute
from turnip.runtime.errors import BackendError, PlanError, RuntimeStall, VertexFailed

BACKENDS = ("cpu", "cuda")


def open_backend(name: str, mg, streams_per_gpu: int = 5, **options):
    """Load plan ``mg`` on backend ``name`` ('cpu' or 'cuda'): allocate its memory, build every view and
    closure. ``options`` go to the backend (cpu: ``chaos``, ``chaos_max_s``, ``poison``; cuda: ``devices``,
    ``gemm``, ``fast``, ``bound``, ``device_start``). The plan is checked first (``plancheck.check_plan``,
    ``PlanError`` naming the first offending vertex), before any backend library is imported."""
    from turnip.runtime.plancheck import check_plan

    check_plan(mg)
    if name == "cpu":
        from turnip.runtime.cpu import CpuBackend

        return CpuBackend(mg, streams_per_gpu, **options)
    if name == "cuda":
        from turnip.runtime.cuda import CudaBackend

        return CudaBackend(mg, streams_per_gpu, **options)
    raise ValueError(f"unknown backend {name!r}; choose from {BACKENDS}")


def open_loaded(name: str, tg, mg, streams_per_gpu: int = 5, seed: int = 0, **options):
    """``open_backend`` with the plan's inputs written: random weights and activations from ``seed``
    (``weights.iter_random_inputs``), filled by threads (``weights.write_random_inputs``). The backend is
    closed again if writing fails. For measurements, where what matters is the plan's timing, not its numbers."""
    from turnip.runtime.weights import write_random_inputs

    be = open_backend(name, mg, streams_per_gpu, **options)
    try:
        write_random_inputs(be, tg, seed)
    except BaseException:
        be.close()
        raise
    return be


__all__ = ["BACKENDS", "BackendError", "PlanError", "RunResult", "RuntimeStall", "VertexFailed", "execute",
           "open_backend", "open_loaded"]  # fmt: skip
