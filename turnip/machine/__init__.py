"""The machine a plan runs on: profiles, per-vertex costs and the plan's lower bound.

Both clocks use these: the simulator (``sim``) draws its durations around the floors here, and the real
runtime reports the same lower bound next to its measured times; neither imports the other.

from turnip.machine import load_profile, lower_bound, VertexCosts
lower_bound(VertexCosts(mg, load_profile("h100")))["lower_bound_ns"]

Modules: ``profile`` (``MachineProfile``, ``load_profile``; files in ``profiles/``, format in
``docs/profile.md``), ``tables`` (measured kernel and copy tables and their interpolation), ``costs``
(engine classes, floors, launch costs, ``vertex_work``), ``bound`` (``lower_bound``: a makespan no run beats;
``floor_estimate``: the simulator's power model's starting estimate, not a bound).
"""

from turnip.machine.bound import floor_estimate, lower_bound, plan_bound
from turnip.machine.costs import VertexCosts, vertex_work, work_of
from turnip.machine.profile import MachineProfile, h100, load_profile, profile_names

__all__ = ["MachineProfile", "VertexCosts", "floor_estimate", "h100", "load_profile", "lower_bound", "plan_bound",
           "profile_names", "vertex_work", "work_of"]  # fmt: skip
