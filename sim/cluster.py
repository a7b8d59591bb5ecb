"""A sweep's tasks on a ``dask.distributed`` cluster: ``ClusterSweep``, the pool ``turnip ablate --scheduler``
passes to ``sim.sweep.run_sweep``, over ``DaskPool``, a client that maps functions over the cluster.

``DaskPool(scheduler)`` is opened as a context manager: ``local:N`` starts a ``LocalCluster`` of N worker
processes of one thread each on this machine (closed again on exit); any other address is an existing
scheduler (``tcp://host:8786``) that the pool connects to. Its state is one ``Client`` (and the cluster it
started), a token that keeps its task keys apart from other clients' on a shared scheduler, and a counter of
the keys it made. Handles are the client's futures, opaque to callers: they pass them as task arguments.

A worker that dies is the scheduler's business: the tasks it was running or whose results it held are run
again elsewhere (up to ``distributed.scheduler.allowed-failures`` deaths per task, then ``ClusterError``).
Nothing here imports dask before a pool is opened: ``import sim.cluster`` works without it.

The workers share no files with the sweep: a plan travels as its file's bytes (compiled on a worker, or read
from ``out/plans`` when cached there) and is written under ``out/plans`` here; the machine profile travels as
the loaded object. Runs go in tasks of up to ``RUNS_PER_TASK`` runs of one plan (a task costs milliseconds of
scheduling), and each worker keeps the last ``PLANS_PER_WORKER`` plans it ran loaded.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from sim.sweep import compile_plan, plan_path, run_row
from turnip.machine.profile import load_profile

CONNECT_TIMEOUT_S = 10  # to reach the scheduler, and for a worker to join it
INSTALL = "pip install 'turnip[cluster]'"
RUNS_PER_TASK = 32
PLANS_PER_WORKER = 2
# the local cluster's settings: no statistical profiler (it samples a worker's running task every 10 ms, for a
# dashboard local:N does not start) and housekeeping every second, not every 20-100 ms; with the defaults an
# idle worker used 5% of a core and the scheduler's process 7.5%, with these 0.5% and 1.2%
LOCAL_CONFIG = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.admin.system-monitor.interval": "5s",
    "distributed.worker.memory.monitor-interval": "1s",
}


class ClusterError(RuntimeError):
    """The cluster cannot run the work: dask missing, no scheduler or no worker, a worker with other turnip
    code, or a task whose workers kept dying."""


def parse_scheduler(scheduler: str) -> int | str:
    """``local:N`` -> N, the worker processes to start here; else the scheduler's address, as given
    (``tcp://host:8786``, ``host:8786``). ``ValueError`` says what is wrong with a malformed one."""
    kind, _, rest = scheduler.partition(":")
    if kind == "local":
        if not rest.isdigit() or int(rest) < 1:
            raise ValueError(f"{scheduler!r}: local:N takes a number of worker processes >= 1, e.g. local:2")
        return int(rest)
    proto, sep, loc = scheduler.rpartition("://")
    host, colon, port = loc.rpartition(":")
    if not colon or not host or not port.isdigit() or (sep and not proto.isalnum()):
        raise ValueError(f"{scheduler!r} is not a scheduler address; pass tcp://HOST:PORT (e.g. tcp://10.0.0.5:8786, "
                         "the address `dask scheduler` prints) or local:N")  # fmt: skip
    return scheduler


def distributed_module():
    """``distributed``, or ``ClusterError`` saying how to install it."""
    try:
        import distributed
    except ImportError as e:
        raise ClusterError(
            f"--scheduler needs dask.distributed, which is not installed here ({e}); {INSTALL}"
        ) from None
    return distributed


def _value(x):
    return x


class DaskPool:
    """``with DaskPool("local:2") as pool``: ``submit`` tasks, get their ``results`` as they finish."""

    def __init__(self, scheduler: str):
        self.scheduler = scheduler
        self.target = parse_scheduler(scheduler)
        self.client = self.cluster = None
        self.token = uuid.uuid4().hex[:8]
        self.n_keys = 0

    def __enter__(self) -> DaskPool:
        d = distributed_module()
        try:
            if isinstance(self.target, int):
                import dask

                # LOCAL_CONFIG is passed on to the worker processes; the HTTP server on a free port, not 8787
                with dask.config.set(LOCAL_CONFIG):
                    self.cluster = d.LocalCluster(n_workers=self.target, threads_per_worker=1, processes=True,
                                                  dashboard_address=":0")  # fmt: skip
                self.client = d.Client(self.cluster)
            else:
                self.client = d.Client(self.target, timeout=CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            self.__exit__(None, None, None)
            raise ClusterError(f"cannot reach the Dask scheduler at {self.scheduler} ({type(e).__name__}: {e}); start "
                               "one with `dask scheduler` and pass the address it prints") from None  # fmt: skip
        try:
            self.client.wait_for_workers(1, timeout=CONNECT_TIMEOUT_S)
        except TimeoutError:
            self.__exit__(None, None, None)
            raise ClusterError(f"the Dask scheduler at {self.scheduler} has no workers after {CONNECT_TIMEOUT_S} s; "
                               f"start some with `dask worker {self.scheduler} --nthreads 1`") from None  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        for x in (self.client, self.cluster):
            if x is not None:
                x.close()
        self.client = self.cluster = None

    @property
    def n_workers(self) -> int:
        return len(self.client.nthreads())

    @property
    def where(self) -> str:
        n = self.n_workers
        at = f"a local Dask cluster ({self.client.scheduler.address})" if self.cluster else self.scheduler
        return f"{n} Dask worker{'s' * (n != 1)} of {at}"

    def _key(self, name: str) -> str:
        self.n_keys += 1
        return f"{name}-{self.token}-{self.n_keys}"

    def keep(self, obj, name: str):
        """A handle of ``obj`` kept on the cluster (made by a task, so made again when its worker dies)."""
        return self.client.submit(_value, obj, key=self._key(name))

    def submit(self, fn: Callable, args: Sequence[tuple], name: str) -> list:
        """One task ``fn(*a)`` per tuple of ``args`` (handles in them stand for their values), in that order of
        priority; their handles."""
        return [self.client.submit(fn, *a, key=self._key(name), priority=-i) for i, a in enumerate(args)]

    def results(self, handles: list) -> Iterator[tuple[int, object]]:
        """(index in ``handles``, result) of each task as it finishes; each handle is dropped (set to None) once
        its result is here. A task that raised raises here; one whose workers kept dying, or a lost scheduler,
        raises ``ClusterError``."""
        d = distributed_module()
        index = {f.key: i for i, f in enumerate(handles)}
        done = d.as_completed(handles, with_results=True)
        try:
            for f, res in done:
                handles[index[f.key]] = None
                yield index[f.key], res
        except d.scheduler.KilledWorker as e:
            raise ClusterError(f"workers kept dying while running a task ({e}); see the workers' logs (out of "
                               "memory?)") from None  # fmt: skip
        except d.client.FutureCancelledError as e:
            raise ClusterError(f"a task was cancelled ({e}): did the Dask scheduler at {self.scheduler} go "
                               "away?") from None  # fmt: skip
        finally:
            done.clear()

    def same_everywhere(self, fn: Callable[[], object], what: str) -> None:
        """``fn()`` on every worker equal to its value here, else ``ClusterError`` naming the first worker that
        differs (a worker that cannot run it at all is one)."""
        here = fn()
        for worker, there in self.client.run(fn, on_error="return").items():
            if isinstance(there, BaseException):
                raise ClusterError(f"worker {worker} cannot run turnip ({type(there).__name__}: {there}); install "
                                   "the same turnip on every worker") from None  # fmt: skip
            if there != here:
                raise ClusterError(f"worker {worker} has other {what} ({there} here {here}); install the same turnip "
                                   "on every worker")  # fmt: skip


def code_fingerprint() -> str:
    """Short hash of the source of every module a sweep's task runs (compiler, simulator, metrics)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(f for pkg in ("turnip", "sim", "analysis") for f in (root / pkg).rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def compile_bytes(p: dict, prof) -> tuple[float, str | None, bytes | None]:
    """A worker's compile of configuration ``p`` (``prof``: the sweep's machine profile, which picks the split
    of an ``auto`` one): (seconds, error, the plan file's bytes), the file written in a directory of its own."""
    with tempfile.TemporaryDirectory(prefix="turnip-plan-") as d:
        (Path(d) / "plans").mkdir()
        _, dt, err = compile_plan((Path(d), p), prof)
        return dt, err, None if err else plan_path(Path(d), p).read_bytes()


_HELD: OrderedDict = OrderedDict()  # plan name -> (profile, memgraph, timing model), most recent last
_HELD_LOCK = threading.Lock()


def run_held(name: str, plan: tuple, prof, tasks: list[tuple]) -> list[tuple[dict, dict | None, object]]:
    """A worker's runs of one plan: ``plan`` is what ``compile_bytes`` returned for the plan file ``name``,
    ``prof`` the sweep's machine profile; ``run_row``'s result for each task."""
    with _HELD_LOCK:  # a worker may run tasks in several threads
        held = _HELD.pop(name, None)
        if held is None or (held[0] is not prof and held[0] != prof):
            from sim.timing import TimingModel
            from turnip.memgraph.io import load_plan

            with tempfile.TemporaryDirectory(prefix="turnip-plan-") as d:
                (Path(d) / name).write_bytes(plan[2])
                mg = load_plan(Path(d) / name)[0]
            held = (prof, mg, TimingModel(mg, prof))
        _HELD[name] = held
        while len(_HELD) > PLANS_PER_WORKER:
            _HELD.popitem(last=False)
    return [run_row(held[1], held[2], prof, t) for t in tasks]


def chunks(names: list[str], n_workers: int) -> list[list[int]]:
    """The runs (indices into ``names``, each run's plan) grouped into tasks: consecutive runs of one plan, at
    most ``RUNS_PER_TASK`` of them and few enough that every worker gets about four tasks."""
    size = max(1, min(RUNS_PER_TASK, len(names) // (4 * n_workers)))
    out: list[list[int]] = []
    for i, n in enumerate(names):
        if out and names[out[-1][-1]] == n and len(out[-1]) < size:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _write_bytes(path: Path, data: bytes) -> None:
    from turnip.fileio import atomic_write

    with atomic_write(path, "wb") as f:  # never half-written
        f.write(data)


class ClusterSweep:
    """A sweep's pool (``sim.sweep.run_sweep(pool=...)``) on the Dask cluster at ``scheduler`` (or ``local:N``);
    ``profile``: the sweep's machine profile (``SweepConfig.profile``), loaded here and sent to the workers,
    which compile (an ``auto`` split) and simulate with it. A plan compiled on a worker stays there as its file's
    bytes; its runs take it as an argument, so the cluster moves it to the workers that run them and compiles
    it again if the worker holding it dies."""

    def __init__(self, scheduler: str, profile: str):
        self.pool, self.profile = DaskPool(scheduler), load_profile(profile)
        self.plans: dict[str, object] = {}  # plan file name -> handle of (seconds, error, bytes)

    def __enter__(self) -> ClusterSweep:
        self.pool.__enter__()
        try:
            self.pool.same_everywhere(code_fingerprint, "turnip code (source hash)")
            self.where = self.pool.where
            self.prof = self.pool.keep(self.profile, "ablate-profile")  # the object: no profile file needed there
        except BaseException:
            self.pool.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.pool.__exit__(*exc)

    def compile(self, out: Path, plans: list[dict]) -> Iterator[tuple[dict, float, str | None]]:
        todo = []
        for p in plans:
            path = plan_path(out, p)
            if path.exists():
                self.plans[path.name] = self.pool.keep((0.0, None, path.read_bytes()), "ablate-plan")
                yield p, 0.0, None
            else:
                todo.append(p)
        handles = self.pool.submit(compile_bytes, [(p, self.prof) for p in todo], "ablate-compile")
        for i, (dt, err, data) in self.pool.results(list(handles)):  # (handles keeps them for the runs)
            if err is None:
                path = plan_path(out, todo[i])
                _write_bytes(path, data)
                self.plans[path.name] = handles[i]
            yield todo[i], dt, err

    def run(self, out: Path, tasks: list[tuple]) -> Iterator[tuple[int, tuple]]:
        names = [plan_path(out, t[0]).name for t in tasks]
        groups = chunks(names, self.pool.n_workers)
        args = [(names[g[0]], self.plans[names[g[0]]], self.prof, [tasks[i] for i in g]) for g in groups]
        for k, res in self.pool.results(self.pool.submit(run_held, args, "ablate-runs")):
            yield from zip(groups[k], res, strict=True)
