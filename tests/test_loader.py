"""The threaded checkpoint loader (``Checkpoint.inputs``, ``turnip.runtime.loader``) writes the same bytes as
the one-tensor-at-a-time path (``iter_inputs``): fp32, fp16 and bf16 files into fp16, bf16 and fp32 tiles,
sharded, Hugging Face names, Phi-3's fused tensors, tiles split along later dimensions, pieces and row blocks
smaller than a tensor; a truncated file or an fp16 overflow is one line naming the file and tensor."""

import json
import os
import threading

import ml_dtypes
import numpy as np
import pytest

import turnip.runtime.loader as ld
from turnip.checkpoint import Checkpoint, CheckpointError, write_checkpoint
from turnip.compile import make_taskgraph
from turnip.hfconfig import hf_source
from turnip.runtime.loader import HostRegion
from turnip.runtime.weights import logical_inputs, write_streaming

pytestmark = pytest.mark.unit

CONFIG = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 101, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 256, "tie_word_embeddings": False}  # fmt: skip
ARCH = {"llama": "LlamaForCausalLM", "phi3": "Phi3ForCausalLM"}
TILES = {"t": 8, "h": 1, "f": 48, "v": 51}  # heads, FFN and vocabulary split: wo and w_down tiles are strided
SEQ = 16


def taskgraph(tmp_path, arch: str = "llama", dtype: str = "fp16"):
    d = tmp_path / f"cfg-{arch}-{dtype}"
    d.mkdir(exist_ok=True)
    cfg = CONFIG | {"model_type": arch, "architectures": [ARCH[arch]]}
    (d / "config.json").write_text(json.dumps(cfg))
    return make_taskgraph(str(d), SEQ, 1, dtype, TILES, budget_nbytes=40_000, head="last"), cfg


def hf_checkpoint(path, tg, cfg, disk: str, shard_nbytes=None, seed: int = 0):
    """A Hugging Face directory with every tensor ``tg`` reads (fused ones once), random values."""
    rng = np.random.default_rng(seed)
    shapes = {k: v[0] for k, v in logical_inputs(tg).items()}
    tensors = {"model.embed_tokens.weight": rng.standard_normal((cfg["vocab_size"], cfg["hidden_size"]))}
    for k in shapes:
        if k != "x0":
            name, shape, _ = hf_source(cfg["model_type"], k, shapes)
            tensors[name] = rng.standard_normal(shape) * (2.0 if k.endswith("norm") else 0.3)
    return Checkpoint(write_checkpoint(path, cfg, tensors, shard_nbytes=shard_nbytes, dtype=disk))


def both_ways(tg, ck, ids=None, threads=None) -> tuple[np.ndarray, np.ndarray]:
    """The host regions written by the old path and by the loader."""
    old, new = HostRegion(tg), HostRegion(tg)
    write_streaming(old, tg, iter(ck.iter_inputs(tg, ids)))
    src = ck.inputs(tg, ids, threads=threads)
    n = write_streaming(new, tg, src)
    assert n == int(tg.nbytes[tg.kind == 0].sum()) and src.nbytes_read > 0 and "GB/s" in src.summary()
    return old.host_in, new.host_in


@pytest.mark.parametrize("arch", ["llama", "phi3"])
@pytest.mark.parametrize("disk", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("compute", ["fp16", "bf16", "fp32"])
def test_the_same_bytes_as_one_tensor_at_a_time(tmp_path, monkeypatch, arch, disk, compute):
    """Tiny pieces and conversion chunks: every tensor is many tasks, strided tiles many row blocks."""
    monkeypatch.setattr(ld, "PIECE_NBYTES", 1000)
    monkeypatch.setattr(ld, "CONVERT_NBYTES", 300)
    monkeypatch.setattr(ld, "CHUNK_ELEMS", 100)
    tg, cfg = taskgraph(tmp_path, arch, compute)
    ck = hf_checkpoint(tmp_path / "m", tg, cfg, disk, shard_nbytes=20_000)
    assert len(ck.files) > 2
    ids = np.random.default_rng(3).integers(0, cfg["vocab_size"], SEQ)
    old, new = both_ways(tg, ck, ids, threads=3)
    assert old.any() and np.array_equal(old, new)


def test_one_thread_default_pieces_and_random_ids(tmp_path):
    tg, cfg = taskgraph(tmp_path)
    ck = hf_checkpoint(tmp_path / "m", tg, cfg, "bf16")
    old, new = both_ways(tg, ck, threads=1)
    assert np.array_equal(old, new)


def test_opening_a_bf16_checkpoint_readies_the_conversion_in_the_background(tmp_path, monkeypatch):
    """A checkpoint with bf16 tensors starts ``warm_conversion`` (once per process: a second one does not start
    another thread); an fp16 one does not; the load then gives the same bytes."""
    started = []
    monkeypatch.setattr(ld, "_WARMING", [])
    real = ld.warm_conversion
    monkeypatch.setattr(ld, "warm_conversion", lambda: started.append(real()) or started[-1])
    tg, cfg = taskgraph(tmp_path)
    hf_checkpoint(tmp_path / "h", tg, cfg, "fp16")
    assert started == []
    ck = hf_checkpoint(tmp_path / "m", tg, cfg, "bf16")
    Checkpoint(ck.path)
    assert len(started) == 2 and started[0] is started[1]
    if started[0] is not None:  # numba present: the thread compiles or loads the kernel, then ends
        started[0].join(60)
        assert not started[0].is_alive() and started[0].name == "turnip-warm-bf16"
    old, new = both_ways(tg, ck, threads=2)
    assert np.array_equal(old, new)


def test_a_compiled_plan_on_the_cpu_backend_resident_inputs_too(tmp_path):
    from turnip.compile import build_with_resident
    from turnip.runtime import open_backend

    tg, cfg = taskgraph(tmp_path)
    ck = hf_checkpoint(tmp_path / "m", tg, cfg, "bf16", shard_nbytes=30_000)
    mg = build_with_resident(tg, 60_000, resident="20000")
    got = []
    for src in (iter(ck.iter_inputs(tg)), ck.inputs(tg)):
        with open_backend("cpu", mg, 2) as be:
            write_streaming(be, tg, src)
            got.append([be.host_in.copy(), *(a.copy() for a in be.arenas)])
    assert mg.stats.get("resident_input_nbytes", 0) > 0
    assert all(np.array_equal(a, b) for a, b in zip(*got, strict=True))


@pytest.mark.parametrize("convert", ["compiled", "numpy"])
def test_the_same_values_as_numpy_for_every_bf16(tmp_path, monkeypatch, convert):
    """bf16 -> fp16 in integer steps (compiled in one pass, or numpy's): every bf16 that fits fp16
    (subnormals, zeros, signs) as numpy casts it; a NaN falls back to the cast."""
    if convert == "numpy":
        monkeypatch.setenv("TURNIP_CONVERT", "numpy")
    ld._bf16_kernel.cache_clear()
    monkeypatch.setattr(ld, "_bf16_kernel", ld._bf16_kernel)  # cleared again after the test (the cache)
    assert (ld._bf16_kernel() is None) == (convert == "numpy")
    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = u[(u & 0x7FFF) <= 0x477F].view(ml_dtypes.bfloat16)
    src = ld.Source(tmp_path / "f", 0, x.dtype, x.shape, "t", "t")
    out = np.zeros(x.shape, np.float16)
    ld._put(out, x, ld._Worker(), src, ValueError)
    assert np.array_equal(out.view(np.uint16), x.astype(np.float16).view(np.uint16))
    nan = np.array([1.0, np.nan, -2.0], np.float32).astype(ml_dtypes.bfloat16)
    out = np.zeros(3, np.float16)
    ld._put(out, nan, ld._Worker(), src, ValueError)
    assert out[0] == 1 and np.isnan(out[1]) and out[2] == -2


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, CheckpointError), msg
    return msg


@pytest.mark.parametrize("disk", ["fp16", "bf16"])
def test_a_file_cut_short_after_opening(tmp_path, disk):
    """Straight reads (fp16) and reads into scratch (bf16 -> fp16): the file and its last tensor named."""
    tg, cfg = taskgraph(tmp_path)
    ck = hf_checkpoint(tmp_path / "m", tg, cfg, disk, shard_nbytes=30_000)
    last = ck.files[-1]
    with open(last, "r+b") as f:
        f.truncate(last.stat().st_size - 10)
    with pytest.raises(CheckpointError) as e:
        write_streaming(HostRegion(tg), tg, ck.inputs(tg, threads=4))
    msg = one_line(e)
    tail = max((h for h in map(ck.header, ck.tensor_names) if h.file == last), key=lambda h: h.offset)
    assert str(last) in msg and repr(tail.name) in msg and "cut short" in msg, msg
    with pytest.raises(CheckpointError) as e:  # opened again: refused before reading
        Checkpoint(tmp_path / "m")
    assert last.name in one_line(e) and "truncated" in one_line(e)


def test_values_beyond_fp16_are_refused_naming_the_tensor(tmp_path):
    tg, cfg = taskgraph(tmp_path)
    big = "model.layers.1.mlp.down_proj.weight"
    ck = hf_checkpoint(tmp_path / "m", tg, cfg, "bf16")
    w = ck.read(big).astype(np.float32)
    w[3, 5] = 7e4
    tensors = {k: ck.read(k) for k in ck.tensor_names} | {big: w}
    ck = Checkpoint(write_checkpoint(tmp_path / "m2", cfg, tensors, dtype="bf16"))
    with pytest.raises(CheckpointError) as e:
        write_streaming(HostRegion(tg), tg, ck.inputs(tg))
    msg = one_line(e)
    assert repr(big) in msg and "L1.w_down" in msg and "beyond fp16" in msg and "7.01e+04" in msg, msg


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_no_descriptor_or_thread_is_left_behind(tmp_path):
    tg, cfg = taskgraph(tmp_path)
    ck = hf_checkpoint(tmp_path / "m", tg, cfg, "bf16", shard_nbytes=30_000)
    before, threads = open_fds(), threading.active_count()
    write_streaming(HostRegion(tg), tg, ck.inputs(tg, threads=3))
    with open(ck.files[0], "r+b") as f:
        f.truncate(ck.files[0].stat().st_size - 1)
    with pytest.raises(CheckpointError):
        write_streaming(HostRegion(tg), tg, ck.inputs(tg, threads=3))
    assert open_fds() == before and threading.active_count() == threads


def test_the_benchmark_on_a_tiny_preset(tmp_path, capsys):
    """benchmarks/load_speed.py end to end (page-cached, the baseline compared byte for byte)."""
    from tests.benchscripts import load_script

    bench = load_script("load_speed")
    assert bench.main(["--model", "llama-tiny", "--dir", str(tmp_path / "m"), "--no-cold", "--threads", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "turnip  2 threads" in out and "the same bytes" in out, out


def test_arrays_are_the_stream_as_a_dict(tmp_path):
    tg, cfg = taskgraph(tmp_path, "phi3")
    ck = hf_checkpoint(tmp_path / "m", tg, cfg, "bf16", shard_nbytes=30_000)
    ids = np.arange(SEQ) + 3  # consecutive ids: x0 is one range of the table, read on the workers too
    want, got = dict(ck.iter_inputs(tg, ids)), ck.inputs(tg, ids, threads=3).arrays()
    assert list(got) == list(want)
    assert all(got[k].dtype == want[k].dtype and np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8))
               for k in want)  # fmt: skip


def test_write_arrays_fills_the_region_as_tile_by_tile_writes(tmp_path):
    """``write_arrays`` (threads copying each tile from its array into the host region) gives the same host
    region and arenas (resident inputs) as writing the tiles through ``write_inputs``."""
    from turnip.compile import build_with_resident
    from turnip.runtime import open_backend
    from turnip.runtime.loader import write_arrays
    from turnip.runtime.weights import random_inputs_for, tile_inputs

    tg, _ = taskgraph(tmp_path)
    mg = build_with_resident(tg, 60_000, resident="20000")
    arrays = random_inputs_for(tg, seed=5)
    got = []
    for write in (lambda be: be.write_inputs(tile_inputs(tg, arrays)), lambda be: write_arrays(be, tg, arrays, 3)):
        with open_backend("cpu", mg, 2) as be:
            write(be)
            got.append([be.host_in.copy(), *(a.copy() for a in be.arenas)])
    assert all(np.array_equal(a, b) for a, b in zip(*got, strict=True))


def test_write_tiles_copies_strided_views_straight_into_the_region(tmp_path):
    """``write_tiles``: tiles given as strided views of bigger arrays (a KV cache's head slices) land in the
    host region as ``write_inputs`` of contiguous copies puts them; a value of another dtype is cast on the way."""
    tg, _ = taskgraph(tmp_path)
    rng = np.random.default_rng(5)
    inputs = {int(t): np.asarray(rng.standard_normal(tuple(tg.shape[t])), dtype=np.float16)
              for t in np.flatnonzero(tg.kind == 0)}  # fmt: skip
    views = {}
    for t, x in inputs.items():  # each one a view: every other slice of an array twice as long
        big = np.empty((2 * x.size,), dtype=x.dtype)
        big[::2] = x.reshape(-1)
        views[t] = big[::2]
    first = next(iter(views))
    views[first] = inputs[first].astype(np.float32)  # another dtype: write_inputs' cast
    old, new = HostRegion(tg), HostRegion(tg)
    old.write_inputs(inputs)
    n = ld.write_tiles(new, tg, views, threads=3)
    assert n == sum(int(tg.nbytes[t]) for t in inputs)
    assert np.array_equal(old.host_in, new.host_in)


def test_the_cache_write_benchmark_on_a_tiny_preset(capsys):
    """benchmarks/cache_write.py end to end: both ways write the same bytes."""
    from tests.benchscripts import load_script

    assert load_script("cache_write").main(["--model", "tiny", "--batch", "2", "--blocks", "2", "--block", "8",
                                            "--pairs", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "the same bytes" in out and "write_tiles" in out, out


def test_lazy_random_weights_are_the_random_inputs_made_one_at_a_time(tmp_path, monkeypatch):
    """``lazy_random_inputs``: the values ``iter_random_inputs`` gives, each made when asked for and not kept; sizes
    known without making them; ``write_arrays`` makes one array at a time (each copied before the next is made)
    and fills the region as the arrays themselves would."""
    from turnip.compile import build_with_resident
    from turnip.runtime import open_backend
    from turnip.runtime.loader import write_arrays
    from turnip.runtime.weights import (
        LazyWeights,
        iter_random_inputs,
        lazy_random_inputs,
        select_weights,
        weight_nbytes,
    )

    tg, _ = taskgraph(tmp_path)
    eager = dict(iter_random_inputs(tg, 4))
    lazy = lazy_random_inputs(tg, 4)
    assert isinstance(lazy, LazyWeights) and list(lazy) == list(eager)
    for k, x in eager.items():
        assert lazy.shape(k) == x.shape and weight_nbytes(lazy, k) == weight_nbytes(eager, k) == x.nbytes
        np.testing.assert_array_equal(lazy[k], x)
    w = next(k for k, x in eager.items() if x.dtype != np.int32 and x.ndim == 2 and k != "tok_embed")
    assert lazy[w] is not lazy[w]  # made again each time, kept by nobody
    with pytest.raises(KeyError):
        lazy["nothing"]
    names = [k for k in eager if k.endswith("norm")]
    assert list(select_weights(lazy, names)) == list(select_weights(eager, names)) == names
    mg = build_with_resident(tg, 60_000, resident="20000")
    made, live, most = [], [0], [0]
    make = lazy._make

    def counting(name):
        made.append(name)
        live[0] += 1
        most[0] = max(most[0], live[0])
        return make(name)

    def copy_all(jobs, threads, pinner=None):
        live[0] = 0  # the arrays of the jobs copied are dropped after
        return real(jobs, threads, pinner)

    real = ld._copy_all
    monkeypatch.setattr(ld, "_copy_all", copy_all)
    got = []
    for arrays in (eager, LazyWeights(lazy._specs, counting)):
        with open_backend("cpu", mg, 2) as be:
            write_arrays(be, tg, arrays, 3)
            got.append([be.host_in.copy(), *(a.copy() for a in be.arenas)])
    assert all(np.array_equal(a, b) for a, b in zip(*got, strict=True))
    assert made == list(eager) and most[0] == 1  # one array alive at a time
