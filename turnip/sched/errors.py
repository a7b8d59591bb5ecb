"""Typed errors of the scheduler core. Each names the vertices involved and what they wait for."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StuckVertex:
    v: int
    label: str
    waits_for: str

    def __str__(self) -> str:
        return f"{self.label}: waits for {self.waits_for}"


class SchedulerStall(RuntimeError):
    """Nothing is running, nothing can launch, and vertices are left."""

    def __init__(self, t_ns: int, n_left: int, stuck: list[StuckVertex]):
        self.t_ns = t_ns
        self.n_left = n_left
        self.stuck = stuck
        lines = "\n  ".join(str(s) for s in stuck)
        more = f"\n  ... and {n_left - len(stuck)} more" if n_left > len(stuck) else ""
        super().__init__(
            f"scheduler stalled at t={t_ns} ns: nothing running, nothing launchable, "
            f"{n_left} vertices left:\n  {lines}{more}"
        )


class ProtocolError(RuntimeError):
    """The driver reported something impossible (a completion of a vertex that is not running, ...)."""
