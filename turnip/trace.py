"""One trace schema for simulated and real runs (documented in ``docs/trace.md``).

A trace is two column tables of numpy arrays:
  spans   one row per memgraph vertex executed (``SPAN_COLUMNS``)
  memory  bytes in use per GPU as a step function (``MEMORY_COLUMNS``)
``to_chrome`` turns them into Chrome trace JSON (opens in Perfetto / chrome://tracing) and ``from_chrome`` /
``read_chrome`` read one back (every span column and the memory counter, exactly); ``to_frames`` gives
pandas DataFrames (pandas imported only there). Importable with numpy alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SPAN_COLUMNS = {
    "v": "memgraph vertex id",
    "kind": "input | kernel | transfer | offload | reload",
    "op": "kernel op name (einsum, sum_into, ...) or the kind for copies",
    "engine": "kernel | h2d | d2h | p2p: the device engine that executed it",
    "gpu": "issuing GPU (a transfer's source); its stream slot and track belong here",
    "src_gpu": "copy source GPU, -1 for host memory",
    "dst_gpu": "copy destination GPU, -1 for host memory",
    "stream": "stream slot of the issuing GPU held from issue to done",
    "host_start_ns": "host began issuing the command",
    "issue_ns": "command handed to the device (host launch call returned)",
    "start_ns": "device began executing it",
    "end_ns": "device finished it",
    "done_ns": "scheduler learned of the completion (slot and resources freed)",
    "nbytes": "bytes written (offload: bytes copied to host)",
    "flops": "arithmetic work (0 for copies)",
}
MEMORY_COLUMNS = {
    "gpu": "GPU",
    "t_ns": "from this instant on ...",
    "bytes_in_use": "... this many bytes of the GPU arena hold live buffers",
}
_ENGINE_OF_KIND = ("h2d", "kernel", "p2p", "d2h", "h2d")
_KIND_NAMES = ("input", "kernel", "transfer", "offload", "reload")


@dataclass(slots=True)
class Trace:
    spans: dict[str, np.ndarray]
    memory: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        missing = set(SPAN_COLUMNS) - set(self.spans)
        if missing:
            raise ValueError(f"trace spans lack columns {sorted(missing)}")

    def __len__(self) -> int:
        return len(self.spans["v"])

    def to_frames(self):
        """(spans DataFrame, memory DataFrame)."""
        import pandas as pd

        return pd.DataFrame(self.spans), pd.DataFrame(self.memory or {k: [] for k in MEMORY_COLUMNS})

    def to_chrome(self) -> dict:
        return to_chrome(self)

    def write_chrome(self, path: str | Path) -> None:
        """Write the Chrome trace JSON atomically (a temporary file renamed into place)."""
        from turnip.fileio import atomic_write

        text = json.dumps(to_chrome(self), separators=(",", ":"))
        with atomic_write(path) as f:
            f.write(text)


def spans_from_plan(mg, issue_ns, start_ns, end_ns, done_ns, stream, host_start_ns) -> dict[str, np.ndarray]:
    """Span columns for every vertex of memgraph ``mg`` from per-vertex time arrays (sim or runtime)."""
    kind = np.asarray(mg.kind, dtype=np.int64)
    transfer = kind == 2
    from_host = (kind == 0) | (kind == 4)
    return {
        "v": np.arange(mg.n, dtype=np.int64),
        "kind": np.asarray(_KIND_NAMES, dtype=object)[kind],
        "op": np.asarray(mg.op, dtype=object),
        "engine": np.asarray(_ENGINE_OF_KIND, dtype=object)[kind],
        "gpu": np.where(transfer, mg.src_gpu, mg.gpu).astype(np.int64),
        "src_gpu": np.where(from_host, -1, np.where(transfer, mg.src_gpu, mg.gpu)).astype(np.int64),
        "dst_gpu": np.where(kind == 3, -1, mg.gpu).astype(np.int64),
        "stream": np.asarray(stream, dtype=np.int64),
        "host_start_ns": np.asarray(host_start_ns, dtype=np.int64),
        "issue_ns": np.asarray(issue_ns, dtype=np.int64),
        "start_ns": np.asarray(start_ns, dtype=np.int64),
        "end_ns": np.asarray(end_ns, dtype=np.int64),
        "done_ns": np.asarray(done_ns, dtype=np.int64),
        "nbytes": np.where(mg.preloaded(), 0, mg.out_nbytes).astype(np.int64),  # resident: moved at load
        "flops": np.asarray(mg.flops, dtype=np.float64),
    }


def _track(s: dict, i: int) -> str:
    e = s["engine"][i]
    if e == "p2p":
        return f"p2p to gpu {s['dst_gpu'][i]}"
    return "compute" if e == "kernel" else e


def to_chrome(tr: Trace) -> dict:
    """Chrome trace JSON: process 0 = host (launch spans), process g+1 = GPU g with one track per engine
    (device execution) and one per stream slot (held from issue to done), and a "bytes in use" counter."""
    s = tr.spans
    ev: list[dict] = []
    gpus = sorted({int(g) for g in s["gpu"]} | {int(g) for g in s["dst_gpu"] if g >= 0})
    ev.append({"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "host"}})
    ev.append({"ph": "M", "pid": 0, "tid": 0, "name": "thread_name", "args": {"name": "launch"}})
    tids: dict[tuple[int, str], int] = {}
    for g in gpus:
        ev.append({"ph": "M", "pid": g + 1, "name": "process_name", "args": {"name": f"gpu {g}"}})

    def tid(pid: int, name: str) -> int:
        key = (pid, name)
        if key not in tids:
            tids[key] = len([k for k in tids if k[0] == pid]) + 1
            ev.append({"ph": "M", "pid": pid, "tid": tids[key], "name": "thread_name", "args": {"name": name}})
        return tids[key]

    us = 1e-3
    for i in range(len(s["v"])):
        args = {"v": int(s["v"][i]), "kind": s["kind"][i], "op": s["op"][i], "nbytes": int(s["nbytes"][i])}
        if s["flops"][i]:
            args["flops"] = float(s["flops"][i])
        name = f"{s['op'][i]} {s['v'][i]}"
        pid = int(s["gpu"][i]) + 1 if s["engine"][i] != "h2d" else int(s["dst_gpu"][i]) + 1
        t0, t1 = int(s["start_ns"][i]), int(s["end_ns"][i])
        ev.append({"ph": "X", "name": name, "cat": s["kind"][i], "pid": pid, "tid": tid(pid, _track(s, i)),
                   "ts": t0 * us, "dur": max(t1 - t0, 0) * us, "args": args})  # fmt: skip
        g = int(s["gpu"][i]) + 1
        t0, t1 = int(s["issue_ns"][i]), int(s["done_ns"][i])
        ev.append({"ph": "X", "name": name, "cat": "stream", "pid": g, "tid": tid(g, f"stream {s['stream'][i]}"),
                   "ts": t0 * us, "dur": max(t1 - t0, 0) * us, "args": {"v": args["v"]}})  # fmt: skip
        t0, t1 = int(s["host_start_ns"][i]), int(s["issue_ns"][i])
        ev.append({"ph": "X", "name": name, "cat": "launch", "pid": 0, "tid": 0, "ts": t0 * us,
                   "dur": max(t1 - t0, 0) * us, "args": {"v": args["v"]}})  # fmt: skip
    m = tr.memory
    for i in range(len(m.get("t_ns", ()))):
        ev.append({"ph": "C", "name": "bytes in use", "pid": int(m["gpu"][i]) + 1, "ts": int(m["t_ns"][i]) * us,
                   "args": {"bytes": int(m["bytes_in_use"][i])}})  # fmt: skip
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": {k: str(v) for k, v in tr.meta.items()}}


class TraceFormatError(ValueError):
    """A JSON document that is not a Chrome trace written by ``to_chrome`` (says what is missing)."""


def _ns(us) -> int:
    return round(float(us) * 1000)  # to_chrome wrote integer ns as float µs: this is exact below ~1e15 ns


def _engine_of_track(name: str) -> tuple[str, int | None]:
    """(engine, p2p destination GPU) of a device track name written by ``_track``."""
    if name == "compute":
        return "kernel", None
    if name in ("h2d", "d2h"):
        return name, None
    if name.startswith("p2p to gpu "):
        return "p2p", int(name.rsplit(" ", 1)[1])
    raise TraceFormatError(f"unknown device track {name!r}")


def from_chrome(doc: dict) -> Trace:
    """The ``Trace`` that ``to_chrome`` turned into ``doc``: spans sorted by vertex, memory, meta (as strings)."""
    try:
        return _from_chrome(doc)
    except TraceFormatError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise TraceFormatError(f"malformed event ({type(e).__name__}: {e})") from None


def _from_chrome(doc: dict) -> Trace:
    ev = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(ev, list):
        raise TraceFormatError("no traceEvents list")
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and "tid" in e}
    dev: dict[int, tuple] = {}
    slot: dict[int, tuple] = {}
    launch: dict[int, tuple] = {}
    mem = []
    for e in ev:
        ph = e.get("ph")
        if ph == "C" and e.get("name") == "bytes in use":
            mem.append((int(e["pid"]) - 1, _ns(e["ts"]), int(e["args"]["bytes"])))
        if ph != "X":
            continue
        v, t0 = int(e["args"]["v"]), _ns(e["ts"])
        t1 = t0 + _ns(e["dur"])
        if e["cat"] == "stream":
            slot[v] = (int(e["pid"]) - 1, int(tracks[(e["pid"], e["tid"])].split()[-1]), t0, t1)
        elif e["cat"] == "launch":
            launch[v] = (t0, t1)
        else:
            engine, p2p_dst = _engine_of_track(tracks[(e["pid"], e["tid"])])
            dev[v] = (e["args"], engine, p2p_dst, int(e["pid"]) - 1, t0, t1)
    if not dev:
        raise TraceFormatError("no device spans (events with args.v on a compute/h2d/d2h/p2p track)")
    if set(dev) != set(slot) or set(dev) != set(launch):
        raise TraceFormatError("device, stream and launch spans name different vertices")
    cols: dict[str, list] = {k: [] for k in SPAN_COLUMNS}
    for v in sorted(dev):
        args, engine, p2p_dst, dev_gpu, start, end = dev[v]
        gpu, stream, issue, done = slot[v]
        host_start = launch[v][0]
        src, dst = {"kernel": (gpu, gpu), "h2d": (-1, dev_gpu), "d2h": (gpu, -1), "p2p": (gpu, p2p_dst)}[engine]
        row = (v, args["kind"], args["op"], engine, gpu, src, dst, stream, host_start, issue, start, end, done,
               int(args["nbytes"]), float(args.get("flops", 0.0)))  # fmt: skip
        for k, x in zip(SPAN_COLUMNS, row, strict=True):
            cols[k].append(x)
    spans = {k: np.asarray(x, dtype=object if k in ("kind", "op", "engine") else None) for k, x in cols.items()}
    for k in SPAN_COLUMNS:
        if k not in ("kind", "op", "engine", "flops"):
            spans[k] = spans[k].astype(np.int64)
    spans["flops"] = spans["flops"].astype(np.float64)
    m = np.array(mem, dtype=np.int64).reshape(-1, 3)  # in file order: to_chrome kept the table's (gpu, t_ns)
    memory = {k: m[:, i].copy() for i, k in enumerate(MEMORY_COLUMNS)} if len(m) else {}
    meta = doc.get("otherData") or {}
    return Trace(spans, memory, dict(meta) if isinstance(meta, dict) else {})


def read_chrome(path: str | Path) -> Trace:
    """A Chrome trace JSON file written by ``Trace.write_chrome`` (``TraceFormatError`` if it is not one)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceFormatError(f"not JSON ({e})") from None
    return from_chrome(doc)
