"""Checkpoint loading against the disk and against transformers, on the same safetensors shards.

Writes (or reuses, with ``--dir``) a Hugging Face LLaMA directory of a preset shape with synthetic weights
(``--dtype`` on disk; shards of ``--shard-gb``), then measures, page-cached and then cold:

- ``disk``: one sequential reader over the shard files (16 MiB reads into one buffer, as ``dd`` does);
- ``turnip``: ``write_streaming`` of ``Checkpoint.inputs`` (the thread pool of ``turnip.runtime.loader``) into
  a host input region in the compute dtype (``--compute``): ``--backend host``, a region laid out tile after
  tile in plain memory, touched once first as pinned memory comes (no GPU needed); ``cpu`` or ``cuda``, a
  compiled plan's backend (the cuda backend's region is pinned, write-combined memory);
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=<compute>, device_map=...)`` (``cpu``, or
  ``cuda:0`` when torch sees a GPU), with ``--hf``; on the CPU, where parameters in the file's dtype may stay
  mapped from the files, one value of every page of every parameter is read before the clock stops.

Ratios: turnip's rate over the disk's in the same state, and transformers' time over turnip's. Cold means
every shard's pages dropped from the page cache first (``posix_fadvise(DONTNEED)``, which needs no
privileges; ``vm.drop_caches`` is not touched); where the disk is itself cached below the VM (a virtual disk
on a host's page cache), "cold" is only as cold as that allows: the disk's own rate is measured next to it.
The baseline (unless ``--no-baseline``): the same region written by the one-tensor-at-a-time stream
(``Checkpoint.iter_inputs``), page-cached, timed and its bytes compared.

    PYTHONPATH=. python benchmarks/load_speed.py [--model llama-7b] [--layers N] [--dtype bf16] [--hf]

Memory: the compute-dtype region (about the checkpoint's size) plus the page cache of the shards; with
``--hf`` transformers' copy on top (after turnip's region is freed). ``--layers`` cuts decoder layers.

Seen on a shared 2-core VM (23 GB, a virtual disk whose rate swung from 0.3 to 2.5 GB/s during the day;
other jobs on the cores), LLaMA-7B shapes with 12 layers, 5.38 GB in 4 shards, 2 threads, ``--hf``:
fp16 -> fp16: cached 2.4 s (2.1 GB/s, 0.85x the disk's sequential read from the page cache; one tensor at a
time 4.3 s); cold 5.0 s (1.0 GB/s, 2.0x the sequential read: the virtual disk serves parallel reads
faster; transformers 9.7 s). bf16 -> fp16: cached 6.3 s (0.81 GB/s: the conversion on two cores is the
limit; one tensor at a time 36.5 s, transformers 20.5 s); cold 10.1 s (0.51 GB/s, 0.99x the disk;
transformers 17.4 s). On the CPU transformers keeps parameters already in the compute dtype mapped from the
files (its fp16 -> fp16 cached load, 2.0 s, maps pages and copies nothing); on a GPU it copies them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnip.checkpoint import Checkpoint, write_checkpoint  # noqa: E402
from turnip.models import LLAMA, LlamaConfig  # noqa: E402

PRESETS = {f"llama-{k}": v for k, v in LLAMA.items()} | {
    "llama3-8b": LlamaConfig(4096, 32, 32, 14336, vocab=128256, n_kv_heads=8, rope_theta=500000.0),
}
TORCH_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def hf_config(c: LlamaConfig, layers: int, dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.d_model,
            "intermediate_size": c.d_ffn, "num_hidden_layers": layers, "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.kv_heads, "vocab_size": c.vocab, "rms_norm_eps": 1e-5,
            "rope_theta": float(c.rope_theta), "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "torch_dtype": TORCH_DTYPE[dtype]}  # fmt: skip


def synthetic(shape: tuple, pool: np.ndarray, k: int) -> np.ndarray:
    """A read-only (shape) view of ``pool`` whose rows start ``k``-dependent strides apart: every row
    distinct, no memory of its own (``write_checkpoint`` makes one tensor at a time)."""
    row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else int(shape[0])
    rows = 1 if len(shape) == 1 else shape[0]
    step = max(1, (pool.size - row) // max(1, rows) - k % 7)
    v = np.lib.stride_tricks.as_strided(pool, (rows, row), (step * pool.itemsize, pool.itemsize), writeable=False)
    return v.reshape(shape)


def make_checkpoint(d: Path, c: LlamaConfig, layers: int, dtype: str, shard_gb: float) -> None:
    from turnip.compile import make_taskgraph
    from turnip.hfconfig import hf_source
    from turnip.runtime.weights import logical_inputs

    cfg = hf_config(c, layers, dtype)
    with tempfile.TemporaryDirectory() as t:
        (Path(t) / "config.json").write_text(json.dumps(cfg))
        tg = make_taskgraph(t, 16, 1, "fp16", None, budget_nbytes=16 << 30, head="last")
    shapes = {k: v[0] for k, v in logical_inputs(tg).items()}
    big = max(int(np.prod(hf_source("llama", k, shapes)[1][1:])) for k in shapes if k != "x0")
    pool = (0.02 * np.random.default_rng(0).standard_normal(big + (1 << 22))).astype(np.float32)
    norms = 1.0 + pool[: 1 << 16]
    tensors = {"model.embed_tokens.weight": synthetic((c.vocab, c.d_model), pool, 0)}
    for i, k in enumerate(shapes):
        if k != "x0":
            name, sh, _ = hf_source("llama", k, shapes)
            tensors[name] = synthetic(sh, norms if k.endswith("norm") else pool, i)
    t = time.perf_counter()
    write_checkpoint(d, cfg, tensors, shard_nbytes=int(shard_gb * 1e9), dtype=dtype, overwrite=True)
    print(f"wrote {d} in {time.perf_counter() - t:.1f} s")


def drop_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read(files) -> tuple[int, float]:
    """Bytes and seconds of one sequential pass over ``files`` in 16 MiB reads into one buffer."""
    buf = bytearray(16 << 20)
    n, t = 0, time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while got := os.readv(fd, [buf]):
                n += got
        finally:
            os.close(fd)
    return n, time.perf_counter() - t


def fingerprint(region: np.ndarray) -> int:
    n = region.size // 8 * 8
    return int(region[:n].view(np.uint64).sum(dtype=np.uint64)) + int(region[n:].sum())


class Target:
    """Where turnip loads: a plan's backend (cpu, cuda) or a ``HostRegion`` (host)."""

    def __init__(self, backend: str, d: Path, compute: str, budget: str, seq: int):
        from turnip.compile import compile_model, make_taskgraph, parse_nbytes

        self.be, self.ctx = None, None
        if backend == "host":
            from turnip.runtime.loader import HostRegion

            self.tg = make_taskgraph(str(d), seq, 1, compute, None, budget_nbytes=parse_nbytes(budget), head="last")
            self.be = HostRegion(self.tg, zero=False)
        else:
            from turnip.runtime import open_backend

            self.tg, mg = compile_model(str(d), seq, 1, budget, dtype=compute)
            self.ctx = open_backend(backend, mg, 1)
            self.be = self.ctx.__enter__()
        self.region = self.be.host_in
        self.region[:] = 0  # fault the pages in once, as pinned memory comes

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(None, None, None)
        self.be = self.region = self.ctx = None


def turnip_load(t: Target, ck: Checkpoint, threads: int) -> tuple[int, float]:
    from turnip.runtime.weights import write_streaming

    src = ck.inputs(t.tg, threads=threads)
    s = time.perf_counter()
    write_streaming(t.be, t.tg, src)
    return src.nbytes_read, time.perf_counter() - s


def hf_load(d: Path, compute: str) -> float:
    import torch
    import transformers

    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    auto, _ = transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM  # imported before the clock
    t = time.perf_counter()
    m = auto.from_pretrained(d, dtype=getattr(torch, TORCH_DTYPE[compute]), device_map=dev)
    if dev != "cpu":
        torch.cuda.synchronize()
    else:  # tensors may still be mapped from the files: read a value of every page of every parameter
        for p in m.parameters():
            float(p.detach().reshape(-1)[:: 4096 // p.element_size()].float().sum())
    dt = time.perf_counter() - t
    del m
    return dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-7b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="on disk")
    p.add_argument("--compute", default="fp16", choices=["bf16", "fp16", "fp32"], help="in the host region")
    p.add_argument("--dir", type=Path, default=None, help="checkpoint directory (written when it has none)")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--backend", default="host", choices=["host", "cpu", "cuda"])
    p.add_argument("--budget", default="16GiB", help="GPU budget of the plan (its tiles)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--threads", type=int, nargs="+", default=None, help="default: the loader's (min(16, cores))")
    p.add_argument("--no-cold", action="store_true", help="page-cached only")
    p.add_argument("--hf", action="store_true", help="also time transformers' from_pretrained")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-tensor-at-a-time stream")
    a = p.parse_args(argv)
    from turnip.runtime.loader import THREADS

    c = PRESETS[a.model]
    layers = a.layers or c.n_layers
    tmp = None
    d = a.dir
    if d is None:
        tmp = d = Path(tempfile.mkdtemp(prefix="turnip-load-")) / "model"
    try:
        if not (d / "config.json").is_file():
            make_checkpoint(d, c, layers, a.dtype, a.shard_gb)
        ck = Checkpoint(d)
        files = ck.files
        size = sum(f.stat().st_size for f in files)
        print(f"{a.model} ({layers} layers), {a.dtype} on disk -> {a.compute}: {size / 1e9:.2f} GB in {len(files)} "
              f"file(s), {os.cpu_count()} cores, backend {a.backend}")  # fmt: skip
        target = Target(a.backend, d, a.compute, a.budget, a.seq)
        threads = a.threads or [THREADS]
        states = ["cached"] + ([] if a.no_cold else ["cold"])
        rows = {}
        for state in states:
            if state == "cached":
                disk_read(files)  # into the page cache
            else:
                drop_cache(files)
            n, s = disk_read(files)
            rows[state] = disk = n / s / 1e9
            print(f"{state:<7} disk  sequential read        {s:7.2f} s  {disk:6.2f} GB/s")
            for k in threads:
                if state == "cold":
                    drop_cache(files)
                n, s = turnip_load(target, ck, k)
                print(f"{state:<7} turnip {k:2d} threads           {s:7.2f} s  {n / s / 1e9:6.2f} GB/s  "
                      f"{n / s / 1e9 / disk:4.2f}x disk")  # fmt: skip
                rows[state, k] = s
        if not a.no_baseline:  # the one-tensor-at-a-time stream, page-cached: the same bytes, its time
            from turnip.runtime.weights import write_streaming

            want = fingerprint(target.region)
            target.region[:] = 0
            disk_read(files)
            t = time.perf_counter()
            write_streaming(target.be, target.tg, iter(ck.iter_inputs(target.tg)))
            s = time.perf_counter() - t
            same = fingerprint(target.region) == want
            gain = s / min(rows["cached", k] for k in threads)
            print(f"cached  one tensor at a time        {s:7.2f} s  {size / s / 1e9:6.2f} GB/s  (the threaded load "
                  f"{gain:.1f}x faster; {'the same bytes' if same else 'OTHER BYTES'})")  # fmt: skip
            if not same:
                return 1
        target.close()
        if a.hf:
            for state in states:
                if state == "cold":
                    drop_cache(files)
                else:
                    disk_read(files)
                s = hf_load(d, a.compute)
                best = min(rows[state, k] for k in threads)
                print(f"{state:<7} transformers from_pretrained {s:7.2f} s  {size / s / 1e9:6.2f} GB/s  "
                      f"turnip {s / best:4.2f}x faster")  # fmt: skip
    finally:
        if tmp is not None:
            shutil.rmtree(tmp.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
