"""The discrete-event model of a GPU server, driving the ``turnip.sched`` core in virtual time.

from sim import simulate
from turnip.machine import load_profile
res = simulate(mg, load_profile("h100"), policy="nondet", seed=0)
res.makespan_ns, res.lower_bound_ns

Machine profiles, per-vertex costs and the lower bound are ``turnip.machine`` (the real runtime uses them
too); this package adds the jitter (``sim.timing``) and the event-driven engine (``sim.engine``).
"""

from sim.engine import SimResult, Simulation, fastest_run, simulate
from sim.timing import TimingModel

__all__ = ["SimResult", "Simulation", "TimingModel", "fastest_run", "simulate"]
