"""The host link as several GPUs share it: total copy rates with 1..N GPUs copying at once.

Each GPU of a server has its own PCIe link, but the host side (root complex, memory controllers) caps the
total: on four H100s of one host, host→GPU copies reach 54.8 GB/s on one GPU and 159 GB/s in total on
four, not 4 x 54.8. ``measure_host_links`` measures, for n = 1..N GPUs copying at once, the total rate of
host→GPU copies, GPU→host copies, and both directions at once; ``link_fields`` turns that into the
profile's ``host_h2d_total_bytes_per_s``, ``host_d2h_total_bytes_per_s`` and
``host_both_total_bytes_per_s`` (entry i: the total with i + 1 GPUs), which the simulator and the lower
bound read (``docs/profile.md``).

How: GPU d copies ``reps`` x ``nbytes`` between a pinned host buffer of its own and a device buffer of its
own on its own stream (both directions: one stream each way), the copies of every participating GPU issued
before any is waited for; the total is all bytes moved over the wall time from the first issue to the
last completion (issuing 16-32 asynchronous copies takes well under 1% of it); each point keeps its best
of ``passes``. As the runtime issues copies: ``cuMemcpyHtoDAsync`` / ``cuMemcpyDtoHAsync`` from portable
pinned memory. Needs a GPU; ``python -m turnip.linkprobe`` prints the table.
"""

from __future__ import annotations

import contextlib
import time

MiB = 1 << 20


def measure_host_links(n_gpus: int | None = None, nbytes: int = 256 * MiB, reps: int = 4, passes: int = 3,
                       log=None) -> dict[str, list[float]]:  # fmt: skip
    """``{"h2d": [...], "d2h": [...], "both": [...]}``: total bytes per second over all GPUs copying at once,
    entry i with GPUs 0..i copying (``n_gpus``: how many to go up to; default all visible)."""
    n_gpus = _visible(n_gpus)
    if n_gpus < 1:
        raise RuntimeError("no GPU visible")
    with _set_up(n_gpus, nbytes, lambda d: 2, 2, 2) as (drv, ctx, dev, streams, host):

        def one(n: int, what: str) -> float:
            t0 = time.perf_counter()
            moved = 0
            for d in range(n):
                drv.check(drv.cuCtxSetCurrent(ctx[d]), "cuCtxSetCurrent")
                for _ in range(reps):
                    if what in ("h2d", "both"):
                        drv.check(drv.cuMemcpyHtoDAsync_v2(dev[d][0], host[d][0], nbytes, streams[d][0]), "h2d")
                        moved += nbytes
                    if what in ("d2h", "both"):
                        drv.check(drv.cuMemcpyDtoHAsync_v2(host[d][1], dev[d][1], nbytes, streams[d][1]), "d2h")
                        moved += nbytes
            _wait(drv, ctx[:n], streams)
            return moved / (time.perf_counter() - t0)

        out: dict[str, list[float]] = {"h2d": [], "d2h": [], "both": []}
        for what in out:
            one(1, what)  # warm-up: first touches of the buffers and streams
        for n in range(1, n_gpus + 1):
            for what in out:
                out[what].append(max(one(n, what) for _ in range(max(1, passes))))
            if log is not None:
                rates = ", ".join(f"{k} {v[-1] / 1e9:.1f} GB/s" for k, v in out.items())
                log(f"host link, {n} GPU(s) at once: {rates}")
        return out


def measure_p2p_ports(n_gpus: int | None = None, nbytes: int = 64 * MiB, passes: int = 3) -> dict[str, float]:
    """GPU<->GPU copies through GPU 0's ports (``cuMemcpyPeerAsync``, each on a stream of its source GPU, peer
    access enabled where the GPUs allow it, as the runtime issues them): ``one``: the rate of one copy GPU 0 ->
    GPU 1 alone; ``out``: the total rate of GPU 0 copying to GPUs 1..N-1 at once; ``into``: GPUs 1..N-1
    copying to GPU 0 at once (bytes per second, the best of ``passes``). {} with fewer than three GPUs."""
    n = _visible(n_gpus)
    if n < 3:
        return {}
    # buf[d][s]: d's copy from or to s; streams[d][s]: d's copies to s
    with _set_up(n, nbytes, lambda d: n, n, 0) as (drv, ctx, buf, streams, _):
        for a in range(n):
            for b in range(n):
                if a != b and (a == 0 or b == 0):
                    drv.enable_peer(ctx, range(n), a, b)

        def rate(pairs: list[tuple[int, int]]) -> float:
            best = 0.0
            for _ in range(max(1, passes) + 1):  # the first: warm-up
                t0 = time.perf_counter()
                for src, dst in pairs:
                    drv.check(drv.cuCtxSetCurrent(ctx[src]), "cuCtxSetCurrent")
                    drv.check(drv.cuMemcpyPeerAsync(buf[dst][src], ctx[dst], buf[src][dst], ctx[src], nbytes,
                                                    streams[src][dst]), "cuMemcpyPeerAsync")  # fmt: skip
                for src, dst in pairs:
                    drv.check(drv.cuCtxSetCurrent(ctx[src]), "cuCtxSetCurrent")
                    drv.check(drv.cuStreamSynchronize(streams[src][dst]), "cuStreamSynchronize")
                best = max(best, len(pairs) * nbytes / (time.perf_counter() - t0))
            return best

        return {"one": rate([(0, 1)]), "out": rate([(0, d) for d in range(1, n)]),
                "into": rate([(d, 0) for d in range(1, n)])}  # fmt: skip


def measure_relay(n_gpus: int | None = None, nbytes: int = 64 * MiB, reps: int = 4,
                  passes: int = 3) -> dict[str, float]:  # fmt: skip
    """Host->GPU copies into the last GPU through the other GPUs' host links: ``own``: ``n x reps`` copies of
    ``nbytes`` on the last GPU's stream (its own link); ``relay``: the same copies, GPU d's share issued on a
    stream of GPU d (``cuMemcpyHtoDAsync`` from portable pinned memory straight to the last GPU's memory, peer
    access enabled: GPU d's copy engine reads the host over its own link and writes over NVLink);
    ``staged``: GPU d's share copied into a buffer of its own, then to the last GPU (``cuMemcpyPeerAsync``,
    two streams a GPU so one chunk's hop overlaps the next one's load). Total bytes per second, the best of
    ``passes``. {} with one GPU."""
    n = _visible(n_gpus)
    if n < 2:
        return {}
    last = n - 1
    with _set_up(n, nbytes, lambda d: 2 * reps if d == last else 2, 2, 1) as (drv, ctx, buf, streams, host):
        for d in range(last):
            drv.enable_peer(ctx, range(n), d, last)

        def rate(how: str) -> float:
            best = 0.0
            for _ in range(max(1, passes) + 1):  # the first: warm-up
                t0 = time.perf_counter()
                for d in range(n):
                    src = last if how == "own" else d
                    drv.check(drv.cuCtxSetCurrent(ctx[src]), "cuCtxSetCurrent")
                    for i in range(reps):
                        dst = buf[last][i % len(buf[last])]
                        s = streams[src][i % 2]
                        if how == "staged" and d != last:
                            drv.check(drv.cuMemcpyHtoDAsync_v2(buf[d][i % 2], host[d][0], nbytes, s), "h2d")
                            drv.check(drv.cuMemcpyPeerAsync(dst, ctx[last], buf[d][i % 2], ctx[d], nbytes, s), "peer")
                        else:
                            drv.check(drv.cuMemcpyHtoDAsync_v2(dst, host[src][0], nbytes, s), "h2d")
                _wait(drv, ctx, streams)
                best = max(best, n * reps * nbytes / (time.perf_counter() - t0))
            return best

        return {how: rate(how) for how in ("own", "relay", "staged")}


def _visible(n_gpus: int | None) -> int:
    """How many GPUs a probe uses: ``n_gpus``, at most the visible ones (default all)."""
    from cuda_kernels._numba import cuda

    c = cuda()
    return len(c.gpus) if n_gpus is None else min(int(n_gpus), len(c.gpus))


@contextlib.contextmanager
def _set_up(n: int, nbytes: int, dev_bufs, n_streams: int, host_bufs: int):
    """A probe's buffers on GPUs 0..n-1: per GPU d its context, ``dev_bufs(d)`` device buffers and ``host_bufs``
    portable pinned host buffers of ``nbytes`` each, and ``n_streams`` streams; yields (driver, contexts, device
    buffers, streams, host buffers), each list by GPU. After: every GPU waited for, its streams destroyed and
    buffers freed (however far the setup got), the caller's context current again."""
    from cuda_kernels._numba import cuda
    from cuda_kernels.launch import capture_stream, driver
    from turnip.runtime._cudadrv import Driver

    c = cuda()
    drv = Driver()
    prev = drv.current_context()
    ctx, dev, streams, host = [], [], [], []
    try:
        for d in range(n):
            with c.gpus[d]:
                ctx.append(drv.current_context())
                for made, count, make in ((dev, dev_bufs(d), lambda: drv.device_alloc(nbytes)),
                                          (streams, n_streams, capture_stream),
                                          (host, host_bufs, lambda: drv.host_alloc(nbytes, False))):  # portable
                    made.append([])
                    for _ in range(count):  # one at a time: what a failure leaves made is freed below
                        made[-1].append(make())
        yield drv, ctx, dev, streams, host
    finally:
        for d in range(len(ctx)):
            drv.cuCtxSetCurrent(ctx[d])
            drv.cuCtxSynchronize()
            for s in streams[d] if d < len(streams) else []:
                driver().cuStreamDestroy_v2(s)
            for p in dev[d] if d < len(dev) else []:
                drv.cuMemFree_v2(p)
        if ctx:
            drv.cuCtxSetCurrent(ctx[0])
        for bufs in host:
            for p in bufs:
                drv.cuMemFreeHost(p)
        if prev:
            drv.cuCtxSetCurrent(prev)


def _wait(drv, ctx: list, streams: list) -> None:
    """Wait for every stream of the GPUs of ``ctx`` (the first ``len(ctx)`` of ``streams``)."""
    for d, cx in enumerate(ctx):
        drv.check(drv.cuCtxSetCurrent(cx), "cuCtxSetCurrent")
        for s in streams[d]:
            drv.check(drv.cuStreamSynchronize(s), "cuStreamSynchronize")


PORTS_SERIAL_BELOW = 1.5  # copies out of (into) one GPU at once moving under this many times one copy's rate


def ports_fields(rates: dict[str, float]) -> dict[str, bool]:
    """``p2p_ports_serial`` from ``measure_p2p_ports``: true when several copies out of GPU 0 at once, and
    several into it, move less than ``PORTS_SERIAL_BELOW`` times one copy's bytes per second in total (one
    queue each way); {} without a measurement."""
    if not rates:
        return {}
    serial = max(rates["out"], rates["into"]) < PORTS_SERIAL_BELOW * rates["one"]
    return {"p2p_ports_serial": bool(serial)}


def link_fields(rates: dict[str, list[float]]) -> dict[str, list[float]]:
    """The profile fields of ``measure_host_links``'s totals (bytes per second, entry i: i + 1 GPUs)."""
    return {f"host_{k}_total_bytes_per_s": [float(x) for x in rates[k]] for k in ("h2d", "d2h", "both")}


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m turnip.linkprobe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=None, help="up to this many GPUs at once (default: all visible)")
    ap.add_argument("--mib", type=int, default=256, help="MiB per copy")
    ap.add_argument("--reps", type=int, default=4, help="copies per GPU and direction in one measurement")
    ap.add_argument("--passes", type=int, default=3, help="measurements per point (the best is kept)")
    ap.add_argument("--json", metavar="OUT.json", help="also write the profile fields as JSON")
    ap.add_argument("--p2p", action="store_true", help="also GPU 0's NVLink ports: copies out of it and into it "
                    "at once against one alone (three or more GPUs; p2p_ports_serial)")  # fmt: skip
    ap.add_argument("--relay", action="store_true", help="also host->GPU copies into the last GPU issued by "
                    "every GPU (through their host links and NVLink) against its own link alone")  # fmt: skip
    a = ap.parse_args(argv)
    rates = measure_host_links(a.gpus, a.mib * MiB, a.reps, a.passes, log=print)
    print("| GPUs at once | host->GPU GB/s | GPU->host | both directions |\n|---|---|---|---|")
    for i in range(len(rates["h2d"])):
        print(f"| {i + 1} | " + " | ".join(f"{rates[k][i] / 1e9:.1f}" for k in ("h2d", "d2h", "both")) + " |")
    fields: dict = link_fields(rates)
    if a.p2p:
        ports = measure_p2p_ports(a.gpus, passes=a.passes)
        if ports:
            print(f"GPU<->GPU through GPU 0: one copy {ports['one'] / 1e9:.1f} GB/s; out to {len(rates['h2d']) - 1} "
                  f"GPUs at once {ports['out'] / 1e9:.1f}; into it from them {ports['into'] / 1e9:.1f}")  # fmt: skip
            fields |= ports_fields(ports)
            print(f"p2p_ports_serial = {str(fields['p2p_ports_serial']).lower()}")
        else:
            print("GPU<->GPU ports: fewer than three GPUs, not measured")
    if a.relay:
        relay = measure_relay(a.gpus, passes=a.passes)
        if relay:
            own, via, staged = (relay[k] / 1e9 for k in ("own", "relay", "staged"))
            print(f"host->GPU {len(rates['h2d']) - 1}: its own link {own:.1f} GB/s; relayed by every GPU {via:.1f}; "
                  f"staged through their memory {staged:.1f}")  # fmt: skip
            fields |= {f"relay_{k}_bytes_per_s": float(v) for k, v in relay.items()}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(fields, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
