"""The SimPy model of a GPU server, driving the ``turnip.sched`` core in virtual time.

from sim import simulate, load_profile
res = simulate(mg, load_profile("h100"), policy="nondet", seed=0)
res.makespan_ns, res.lower_bound_ns
"""

from sim.bound import lower_bound
from sim.engine import SimResult, Simulation, simulate
from sim.profile import MachineProfile, h100, load_profile
from sim.timing import TimingModel

__all__ = ["MachineProfile", "SimResult", "Simulation", "TimingModel", "h100", "load_profile", "lower_bound",
           "simulate"]  # fmt: skip
