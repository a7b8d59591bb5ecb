"""The scheduler core: a pure state machine ``handle(event) -> commands``.

It reads no clock, starts no thread and does no I/O: time arrives inside events. The SimPy model in
``sim/`` and the real runtime are thin driver loops around it::

    sched = Scheduler(mg, policy="nondet")
    cmds = sched.handle(RunStarted(t_ns=0))
    while not sched.finished:
        ...perform cmds (Launch / Copy), wait for one to complete...
        cmds = sched.handle(KernelDone(v, t_ns))   # or CopyDone(v, t_ns)

``det-replay`` replays a recorded issue order: ``Scheduler(mg, "det-replay", order=res.order)`` with the
order of an earlier run (``turnip.sched.replay``). ``Scheduler(mg, groups=launch_groups(mg))`` dispatches runs of
kernels as units (``turnip.sched.groups``).
"""

from turnip.sched.core import POLICIES, Scheduler
from turnip.sched.errors import ProtocolError, SchedulerStall, StuckVertex
from turnip.sched.events import Copy, CopyDone, KernelDone, Launch, RunStarted
from turnip.sched.groups import LaunchGroups, launch_groups
from turnip.sched.priority import critical_path_ns, topo_order
from turnip.sched.replay import engine_orders, issue_order

__all__ = [
    "POLICIES",
    "Copy",
    "CopyDone",
    "KernelDone",
    "Launch",
    "LaunchGroups",
    "ProtocolError",
    "RunStarted",
    "Scheduler",
    "SchedulerStall",
    "StuckVertex",
    "critical_path_ns",
    "engine_orders",
    "issue_order",
    "launch_groups",
    "topo_order",
]
