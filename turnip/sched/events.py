"""Events (past-tense facts fed to the scheduler) and commands (imperatives it returns).

All are immutable named tuples: cheap to build (the core creates one per vertex) and easy to log.
Times are integer nanoseconds of whatever clock the driver uses (virtual in ``sim/``, host monotonic in
the runtime).
"""

from __future__ import annotations

from typing import NamedTuple


class RunStarted(NamedTuple):
    """The driver is ready; the scheduler answers with the first launches."""

    t_ns: int = 0


class KernelDone(NamedTuple):
    """Kernel vertex ``v`` completed on its GPU at ``t_ns``."""

    v: int
    t_ns: int


class CopyDone(NamedTuple):
    """Copy vertex ``v`` (input load, offload, reload or GPU→GPU transfer) completed at ``t_ns``."""

    v: int
    t_ns: int


class Launch(NamedTuple):
    """Run kernel vertex ``v`` on stream slot ``stream`` of ``gpu``."""

    v: int
    gpu: int
    stream: int


class Copy(NamedTuple):
    """Perform copy vertex ``v`` on stream slot ``stream`` of ``gpu`` (the issuing GPU).

    ``engine`` is ``"h2d"`` (input / reload into ``dst_gpu``), ``"d2h"`` (offload from ``src_gpu``) or
    ``"p2p"`` (transfer ``src_gpu`` → ``dst_gpu``). Host-side endpoints are given as -1.
    """

    v: int
    engine: str
    src_gpu: int
    dst_gpu: int
    gpu: int
    stream: int


Event = RunStarted | KernelDone | CopyDone
Command = Launch | Copy
