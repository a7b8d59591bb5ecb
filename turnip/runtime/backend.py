"""The backend protocol: what the driver loop needs from a machine, and nothing more.

A backend owns the memory of one plan (GPU arenas, host input and offload regions) and the means to run
its vertices. Everything that costs allocation, view creation or compilation happens in its constructor
(plan load); a run only launches prebuilt closures and reports completions::

    be = CpuBackend(mg, streams_per_gpu=5)      # or CudaBackend(...): allocate, build views and closures
    be.write_inputs({tensor: array, ...})       # fill the host input region; loads resident inputs
    be.load_resident([tensor, ...])             # after host_in was filled directly (weights.write_random_inputs)
    be.begin_run(seed)                          # per-run state (chaos draws, reference events)
    be.submit(cmd)                              # Launch / Copy from the scheduler: issue, return at once
    be.poll(timeout_s) -> [v, ...]              # vertices completed since the last poll (may block)
    be.end_run(t0_ns) -> (start_ns, end_ns)     # device execution times of every vertex of the run
    be.abort()                                  # a run failed: let in-flight work finish, drop it
    be.read_outputs() -> {tensor: array}
    be.close()                                  # free everything once; join every thread

``poll`` raises ``VertexFailed`` naming the vertex when a kernel or copy failed. ``allocations`` counts the
buffers the backend allocated and ``views_built`` the typed views it created; both stay constant during
runs (tests check it).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from turnip.runtime.errors import BackendError


class Backend(Protocol):
    name: str
    allocations: int
    views_built: int

    def write_inputs(self, values: dict[int, np.ndarray], load_resident: bool = True) -> None: ...

    def load_resident(self, tensors) -> None: ...

    def begin_run(self, seed: int | None = None) -> None: ...

    def submit(self, cmd) -> None: ...

    def poll(self, timeout_s: float) -> list[int]: ...

    def end_run(self, t0_ns: int) -> tuple[np.ndarray, np.ndarray]: ...

    def abort(self) -> None: ...

    def read_outputs(self, only=None, views: bool = False) -> dict[int, np.ndarray]: ...

    def in_flight(self) -> list[int]: ...

    def close(self) -> None: ...


def check_ready(be) -> None:
    """``begin_run``'s precondition, shared by the backends: open, and every input tensor written."""
    if be._closed:
        raise BackendError("backend is closed")
    missing = set(be._inputs) - be._written
    if missing:
        raise BackendError(f"no data for input tensors {sorted(missing)[:10]} (call write_inputs first)")
