"""Typed errors of the runtime. Each names the vertex (or vertices) involved."""

from __future__ import annotations


class VertexFailed(RuntimeError):
    """A kernel or copy raised, or the device reported an error for it. The run was stopped."""

    def __init__(self, v: int, label: str, cause: BaseException | str):
        self.v, self.label, self.cause = v, label, cause
        why = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)
        super().__init__(f"vertex {label} failed: {why}")


class RuntimeStall(RuntimeError):
    """No completion arrived for ``idle_s`` seconds (the watchdog's limit) while vertices were in flight."""

    def __init__(self, idle_s: float, in_flight: list[str], n_done: int, n: int):
        self.idle_s, self.in_flight, self.n_done, self.n = idle_s, in_flight, n_done, n
        lines = "\n  ".join(in_flight) or "(none)"
        super().__init__(f"no completion for {idle_s:.3g} s ({n_done} of {n} vertices done); in flight:\n  {lines}")


class BackendError(RuntimeError):
    """A backend could not be set up (no device, a plan that does not fit, missing inputs...)."""


class PlanError(ValueError):
    """A plan fails the checks made before it is loaded (``turnip.runtime.plancheck``): it could crash the
    runtime or make it write outside its memory. Names the first offending vertex (``v``, its ``label``; -1
    and the plan for a header field) and the ``field`` at fault."""

    def __init__(self, v: int, label: str, field: str, why: str):
        self.v, self.label, self.field, self.why = v, label, field, why
        super().__init__(f"{label}: {field} {why}")
