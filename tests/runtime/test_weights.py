"""Weights: random logical inputs, the numpy safetensors writer, Hugging Face names and layouts, bf16."""

import json

import ml_dtypes
import numpy as np
import pytest

from turnip.checkpoint import Checkpoint, load_weights
from turnip.models import llama_prefill
from turnip.runtime.weights import (
    from_hf,
    hf_name,
    hf_shape,
    logical_inputs,
    random_inputs_for,
    tile_inputs,
    write_safetensors,
)

pytestmark = pytest.mark.cpu_runtime


def to_hf(w: dict) -> dict:
    """Our logical weights as a Hugging Face state dict (2-D projections; x0 is not a weight)."""
    return {hf_name(k): np.ascontiguousarray(v.reshape(hf_shape(k, v.shape))) for k, v in w.items() if k != "x0"}


def test_random_inputs_cover_every_tile():
    tg = llama_prefill("tiny", 64)
    w = random_inputs_for(tg, 3)
    assert "ids" not in w and w["x0"].shape == (64, 64) and w["x0"].dtype == np.float16
    assert abs(float(w["x0"].astype(np.float32).std()) - 0.02) < 0.005
    assert abs(float(w["L0.wq"].astype(np.float32).std()) - 0.02) < 0.005
    assert abs(float(w["L1.attn_norm"].astype(np.float32).mean()) - 1.0) < 0.05
    tiles = tile_inputs(tg, w)
    assert set(tiles) == set(np.flatnonzero(tg.kind == 0).tolist())
    assert np.array_equal(random_inputs_for(tg, 3)["L1.w_up"], w["L1.w_up"])
    wb = random_inputs_for(llama_prefill("tiny-gqa", 16, dtype="bf16", head="last"), 3)
    assert {x.dtype for x in wb.values()} == {np.dtype(ml_dtypes.bfloat16)} and wb["L0.wq"].shape == (2, 2, 16, 64)


def read_all(path) -> dict:
    ck = Checkpoint(path)
    return {n: ck.read(n) for n in ck.tensor_names}


def test_safetensors_round_trip(tmp_path):
    xs = {"a": np.arange(6, dtype=np.float16).reshape(2, 3), "b": np.array([1, 2], dtype=np.int32),
          "c": np.array([[1.5, -2.0]], dtype=ml_dtypes.bfloat16)}  # fmt: skip
    write_safetensors(tmp_path / "x.safetensors", xs)
    back = read_all(tmp_path / "x.safetensors")
    assert set(back) == set(xs) and all(back[k].dtype == xs[k].dtype and np.array_equal(back[k], xs[k]) for k in xs)
    header = json.loads((tmp_path / "x.safetensors").read_bytes()[8:].split(b"}}")[0] + b"}}")
    assert header["c"]["dtype"] == "BF16"


def test_bf16_is_read_as_bfloat16(tmp_path):
    vals = np.array([1.5, -2.0, 3e38], dtype=np.float32)
    raw = (vals.view(np.uint32) >> 16).astype("<u2").tobytes()
    h = json.dumps({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
    (tmp_path / "b.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + raw)
    got = read_all(tmp_path / "b.safetensors")["w"]
    truncated = (vals.view(np.uint32) >> 16 << 16).view(np.float32)  # the bytes written: the top halves
    assert got.dtype == ml_dtypes.bfloat16 and np.array_equal(got.astype(np.float32), truncated)


@pytest.mark.parametrize("model", ["tiny", "tiny-gqa"])
def test_hugging_face_names_and_layouts(tmp_path, model):
    """Every weight is its Hugging Face tensor reshaped; a file with either set of names loads, x0 is the
    embedding table's rows of the token ids."""
    tg = llama_prefill(model, 16, head="all")
    ours = random_inputs_for(tg, 0)
    hf = to_hf(ours)
    for k, v in ours.items():
        if k != "x0":
            assert np.shares_memory(from_hf(k, hf[hf_name(k)], v.shape), hf[hf_name(k)])  # a view: no copy
            assert np.array_equal(from_hf(k, hf[hf_name(k)], v.shape), v)
    assert hf_name("L1.wq") == "model.layers.1.self_attn.q_proj.weight"
    assert (hf_name("lm_head"), hf_name("tok_embed")) == ("lm_head.weight", "model.embed_tokens.weight")
    with pytest.raises(KeyError, match="x0"):
        hf_name("x0")
    assert hf_shape("L0.wq", (2, 2, 16, 64)) == (64, 64) and hf_shape("L0.wo", (64, 2, 2, 16)) == (64, 64)
    with pytest.raises(ValueError, match="q_proj"):
        from_hf("L0.wq", np.zeros((64, 64)).T.reshape(64, 4, 16), (4, 16, 64))
    table = ours.get("tok_embed", ours.get("lm_head"))
    hf.setdefault("model.embed_tokens.weight", table)
    ids = np.arange(16) * 5 % len(table)
    write_safetensors(tmp_path / "hf.safetensors", hf)
    got = load_weights(tg, tmp_path / "hf.safetensors", ids=ids)
    assert set(got) == set(ours) and np.array_equal(got["x0"], table[ids])
    assert all(np.array_equal(got[k], ours[k]) for k in ours if k != "x0")
    write_safetensors(tmp_path / "ours.safetensors", ours)  # our names, x0 included
    got = load_weights(tg, tmp_path / "ours.safetensors")
    assert all(np.array_equal(got[k], ours[k]) for k in ours)


def test_streamed_weights_equal_the_dict_of_weights(tmp_path):
    """write_streaming fills the host input region exactly as write_inputs of all tiles at once, from random
    inputs and from a Hugging Face-named safetensors file read one tensor at a time."""
    from turnip.checkpoint import iter_weights
    from turnip.compile import build_with_resident
    from turnip.runtime import open_backend
    from turnip.runtime.weights import iter_random_inputs, write_streaming

    tg = llama_prefill("tiny", 64)
    mg = build_with_resident(tg, 1 << 20)
    w = random_inputs_for(tg, 5)
    with open_backend("cpu", mg) as a, open_backend("cpu", mg) as b:
        a.write_inputs(tile_inputs(tg, w))
        assert write_streaming(b, tg, iter_random_inputs(tg, 5)) == sum(x.nbytes for x in w.values())
        np.testing.assert_array_equal(a.host[0], b.host[0])
    table = (np.random.default_rng(0).standard_normal((64, 64)) * 0.02).astype(np.float16)
    hf = to_hf(w) | {"model.embed_tokens.weight": table}  # no head: the table is only for x0
    write_safetensors(tmp_path / "hf.safetensors", hf)
    ids = np.arange(64)[::-1] % 64
    with open_backend("cpu", mg) as a, open_backend("cpu", mg) as b:
        a.write_inputs(tile_inputs(tg, w | {"x0": hf["model.embed_tokens.weight"][ids]}))
        write_streaming(b, tg, iter_weights(tg, tmp_path / "hf.safetensors", ids=ids))
        np.testing.assert_array_equal(a.host[0], b.host[0])


def test_open_loaded_writes_the_random_inputs_and_closes_on_failure(monkeypatch):
    """open_loaded is open_backend plus the seed's random inputs (write_random_inputs); a write that fails closes
    the backend it opened before the error goes on."""
    import turnip.runtime.cpu as cpu_mod
    from turnip.compile import build_with_resident
    from turnip.runtime import open_backend, open_loaded
    from turnip.runtime.weights import iter_random_inputs, write_streaming

    tg = llama_prefill("tiny", 64)
    mg = build_with_resident(tg, 1 << 20)
    with open_backend("cpu", mg) as a, open_loaded("cpu", tg, mg, seed=3) as b:
        write_streaming(a, tg, iter_random_inputs(tg, 3))
        np.testing.assert_array_equal(a.host[0], b.host[0])
        assert np.any(b.host[0])
    closed = []
    monkeypatch.setattr(cpu_mod.CpuBackend, "load_resident", lambda self, tensors: 1 / 0)
    monkeypatch.setattr(cpu_mod.CpuBackend, "close", lambda self: closed.append(self))
    with pytest.raises(ZeroDivisionError):
        open_loaded("cpu", tg, mg)
    assert len(closed) == 1


def test_bf16_taskgraph_runs_on_the_cpu_backend():
    """A bf16 plan (grouped-query attention, LM head) under a tight budget, with chaos and poisoned memory,
    gives the taskgraph's numpy values (computed in float32 per op, stored as bf16)."""
    from turnip.compile import build_with_resident
    from turnip.memgraph.interp import assemble, evaluate_taskgraph
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import iter_random_inputs, write_streaming

    tg = llama_prefill("tiny-gqa", 32, dtype="bf16", head="all")
    mg = build_with_resident(tg, 32 * 1024)
    assert mg.count(3) > 0, "the budget forces offloads"
    w = random_inputs_for(tg, 2)
    want = evaluate_taskgraph(tg, tile_inputs(tg, w))
    with open_backend("cpu", mg, chaos=0.3, poison=True) as be:
        write_streaming(be, tg, iter_random_inputs(tg, 2))
        for seed in range(3):
            execute(mg, be, "nondet", seed=seed)
            got = assemble(tg, be.read_outputs(), "logits")  # {output tensor: tile}
            assert got.dtype == ml_dtypes.bfloat16
            ref = assemble(tg, want, "logits").astype(np.float32)
            np.testing.assert_allclose(got.astype(np.float32), ref, rtol=0.02, atol=0.01 * np.abs(ref).max())


def test_streamed_weights_keep_one_copy_in_host_memory():
    """Peak host memory of loading a plan's weights: the input region plus one tensor when streamed, twice
    the weights when every logical tensor is made first (measured in fresh processes)."""
    import subprocess
    import sys

    code = """
import resource, sys
from turnip.compile import build_with_resident, make_taskgraph
from turnip.runtime import open_backend
from turnip.runtime.weights import iter_random_inputs, random_inputs_for, tile_inputs, write_streaming
tg = make_taskgraph("llama-7b", 64, 1, "fp16", n_layers=4, budget_nbytes=1 << 30)
mg = build_with_resident(tg, 1 << 30, workspace=0)
weights = sum(int(tg.nbytes[v]) for v in range(tg.n) if tg.kind[v] == 0)
with open_backend("cpu", mg, 1) as be:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if sys.argv[1] == "stream":
        write_streaming(be, tg, iter_random_inputs(tg, 0))
    else:
        be.write_inputs(tile_inputs(tg, random_inputs_for(tg, 0)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print((peak - base) / weights)
"""
    ratio = {m: float(subprocess.run([sys.executable, "-c", code, m], capture_output=True, text=True, check=True)
                      .stdout.split()[-1]) for m in ("stream", "dict")}  # fmt: skip
    assert ratio["stream"] <= 1.2, ratio
    assert ratio["dict"] >= 1.4, ratio  # the check can tell the two apart (about 1.6-2: pages are touched lazily)


def test_logical_inputs_of_a_llama_have_no_ids():
    lg = logical_inputs(llama_prefill("tiny-gqa", 8, head="last"))
    assert "ids" not in lg and lg["x0"][0] == (8, 64) and lg["tok_embed"][0] == (96, 64)


def test_random_x0_of_token_ids_is_rows_of_the_random_table():
    """With token ids, x0 is their rows of the random embedding table (tok_embed where the model has one),
    the same rows whatever the prompt."""
    from turnip.runtime.weights import iter_random_inputs

    tg = llama_prefill("tiny-gqa", 8, head="last")  # tied: tok_embed is an input
    ids = np.array([5, 0, 95, 5, 7, 7, 1, 2])
    w = dict(iter_random_inputs(tg, 1, ids=ids))
    assert np.array_equal(w["x0"], w["tok_embed"][ids]) and w["x0"].dtype == np.float16
    assert abs(float(w["tok_embed"].astype(np.float32).std()) - 0.02) < 0.005
    other = dict(iter_random_inputs(llama_prefill("tiny", 4), 1, ids=[5, 5, 3, 0]))["x0"]  # no table input
    assert np.array_equal(other[0], other[1]) and not np.array_equal(other[0], other[2])
    again = dict(iter_random_inputs(llama_prefill("tiny", 4), 1, ids=[3, 9, 5, 1]))["x0"]
    assert np.array_equal(again[2], other[0]) and np.array_equal(again[0], other[2])
    with pytest.raises(ValueError, match=r"id 96 at position 1 is outside \[0, 96\)"):
        dict(iter_random_inputs(tg, 1, ids=[0, 96, 0, 0, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="3 token ids"):
        dict(iter_random_inputs(tg, 1, ids=[0, 1, 2]))


def test_random_embedding_gives_the_rows_iter_random_inputs_gives():
    from turnip.runtime.weights import iter_random_inputs, random_embedding
    from turnip.train import lora_step

    for model in ("tiny", "tiny-gqa"):
        tg = lora_step(model_cfg(model), seq=16, batch=2, dtype="fp16")
        ids = np.random.default_rng(0).integers(0, model_cfg(model).vocab, 32)
        want = next(x for k, x in iter_random_inputs(tg, 3, ids=ids) if k == "x0")
        np.testing.assert_array_equal(random_embedding(tg, 3)(ids), want)


def model_cfg(name):
    from turnip.models import LLAMA

    return LLAMA[name]


@pytest.mark.parametrize("model", ["llama-tiny", "llama-tiny-gqa"])
@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("resident", ["0", "1GiB"])
def test_threaded_random_fill_writes_the_bytes_of_the_stream(model, gpus, resident):
    """write_random_inputs (1 and 4 threads) fills the host input region and the arenas' resident inputs with
    the bytes write_streaming of iter_random_inputs writes, and a run gives the same outputs. pool_elems=1000
    cuts tensors into many pool pieces, so tiles start and end inside pieces."""
    from turnip.compile import compile_model
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import iter_random_inputs, write_random_inputs, write_streaming

    tg, mg = compile_model(model, 64, gpus, "1MiB", resident=resident)
    assert (int(mg.preloaded().sum()) > 0) == (resident != "0")
    with open_backend("cpu", mg) as a:
        n = write_streaming(a, tg, iter_random_inputs(tg, 4, pool_elems=1000))
        execute(mg, a, "nondet", seed=0)
        want = a.read_outputs()
        for threads in (1, 4):
            with open_backend("cpu", mg) as b:
                assert write_random_inputs(b, tg, 4, threads=threads, pool_elems=1000) == n
                np.testing.assert_array_equal(a.host[0], b.host[0])
                for v in (v for v in range(mg.n) if b.lay.resident[v]):  # loaded into the arenas
                    np.testing.assert_array_equal(a.buf(v), b.buf(v))
                execute(mg, b, "nondet", seed=1)
                got = b.read_outputs()
                assert set(got) == set(want) and all(np.array_equal(got[t], want[t]) for t in want)


def test_threaded_random_fill_with_token_ids_skip_and_bf16():
    """Embedded rows of token ids (x0) and the table (tok_embed) as the stream gives them; names in skip are
    neither written nor change the values of the others (their draws still happen); RandomInputs is the same
    stream and write_streaming of it takes the threaded fill."""
    from turnip.compile import build_with_resident
    from turnip.runtime import open_backend
    from turnip.runtime.weights import RandomInputs, iter_random_inputs, write_random_inputs, write_streaming

    tg = llama_prefill("tiny-gqa", 16, dtype="bf16", head="last")
    mg = build_with_resident(tg, 1 << 20, resident="64KiB")
    ids = np.arange(16) * 5 % 96
    skip = {"L0.wq", "x0", "final_norm"}
    src = RandomInputs(tg, 2, ids=ids, skip=skip)
    assert [k for k, _ in src] == [k for k in logical_inputs(tg) if k not in skip]
    with open_backend("cpu", mg) as a, open_backend("cpu", mg) as b, open_backend("cpu", mg) as c:
        n = write_streaming(a, tg, ((k, x) for k, x in iter_random_inputs(tg, 2, ids=ids) if k not in skip))
        assert write_random_inputs(b, tg, 2, skip=skip, threads=3, ids=ids) == n
        assert write_streaming(c, tg, src) == n
        np.testing.assert_array_equal(a.host[0], b.host[0])
        np.testing.assert_array_equal(a.host[0], c.host[0])
        skipped = {int(t) for k in skip for _, t in logical_inputs(tg)[k][1]}
        assert skipped and skipped.isdisjoint(b._written) and set(a._written) == set(b._written)
        for x, y in zip(a.arenas, b.arenas, strict=True):
            np.testing.assert_array_equal(x, y)


def test_threaded_random_fill_falls_back_to_streaming_without_a_host_region():
    """A backend with no ``host_in`` gets the stream through write_inputs."""
    from turnip.runtime.weights import write_random_inputs

    class Recorder:
        def __init__(self):
            self.got = {}

        def write_inputs(self, values):
            self.got |= {t: np.array(x) for t, x in values.items()}

    tg = llama_prefill("tiny", 8)
    be = Recorder()
    n = write_random_inputs(be, tg, 1, skip={"x0"})
    want = tile_inputs(tg, {k: x for k, x in random_inputs_for(tg, 1).items() if k != "x0"})
    assert n == sum(x.nbytes for x in want.values()) and set(be.got) == set(want)
    assert all(np.array_equal(be.got[t], want[t]) for t in want)


def test_tile_copies_from_pool_pieces_equal_slices_of_the_whole_tensor():
    """_fill_tiles (flat ranges and blocks through pool views, rows across piece boundaries, rows longer than
    a piece) gives the tiles numpy slicing of the whole tensor gives."""
    from turnip.runtime.weights import _copy_pieces, _fill_tiles

    rng = np.random.default_rng(0)
    for _ in range(200):
        shape = tuple(int(n) for n in rng.integers(1, 7, size=int(rng.integers(1, 5))))
        size, pool_elems = int(np.prod(shape)), int(rng.integers(1, 40))
        pool = np.arange(2 * pool_elems, dtype=np.float16) + 1
        offs = rng.integers(pool_elems, size=-(-size // pool_elems)).tolist()
        whole = np.empty(size, np.float16)
        _copy_pieces(whole, pool, offs, pool_elems, 0)
        starts = tuple(int(rng.integers(n)) for n in shape)
        tshape = tuple(int(rng.integers(1, n - s + 1)) for n, s in zip(shape, starts, strict=True))
        region = np.zeros(8 + int(np.prod(tshape)) * 2, np.uint8)
        _fill_tiles(region, [(starts, tshape, 8)], shape, pool, offs, pool_elems)
        want = whole.reshape(shape)[tuple(slice(s, s + m) for s, m in zip(starts, tshape, strict=True))]
        np.testing.assert_array_equal(region[8:].view(np.float16).reshape(tshape), want)


def _pinned_while_filled(b):
    """CPU backend ``b`` given ``pin_while_filling`` as the CUDA backend's (its registered region):
    a ``PiecePinner`` (at most 8 pieces) over its input region, registering with the stand-in driver
    (``FakeDriver``). Returns (driver, region, the pinners made)."""
    from tests.runtime.helpers import FakeDriver
    from turnip.runtime.hostmem import PiecePinner, PinnedRegion, register_spans

    drv, made = FakeDriver(), []
    region = PinnedRegion.adopted(drv, b.host[0], b.host[0].ctypes.data, None)
    region.pinned = False

    def pin_while_filling(writes):
        spans = register_spans(region.nbytes, [o for o, _ in writes], 8)
        made.append(PiecePinner(region, spans, writes, phases=b.load_phases_s))
        return made[-1]

    b.pin_while_filling, b.load_phases_s = pin_while_filling, {}
    return drv, region, made


def _check_pinned(drv, region, made, b):
    (pin,) = made
    assert len(pin.spans) > 1 and all(x == 0 for x in pin._left) and region.pinned
    registered = sorted(c[1:3] for c in drv.calls if c[0] == "register")
    assert registered == [(region.ptr + i, j - i) for i, j in pin.spans]
    assert "pin" in b.load_phases_s


def test_threaded_random_fill_announces_every_tile_to_the_pinner_of_the_region():
    """A backend that pins its input region while it is filled (``pin_while_filling``, the CUDA backend's
    registered region) hears of every tile the threads write: every piece's announced bytes are
    written, the region ends pinned piece by piece, and its bytes are those of a fill without it."""
    from turnip.compile import compile_model
    from turnip.runtime import open_backend
    from turnip.runtime.weights import write_random_inputs

    tg, mg = compile_model("llama-tiny", 64, 1, "1MiB", resident="64KiB")
    with open_backend("cpu", mg) as a, open_backend("cpu", mg) as b:
        n = write_random_inputs(a, tg, 4, threads=4, pool_elems=1000)
        drv, region, made = _pinned_while_filled(b)
        assert write_random_inputs(b, tg, 4, threads=4, pool_elems=1000) == n
        _check_pinned(drv, region, made, b)
        np.testing.assert_array_equal(a.host[0], b.host[0])
        for v in (v for v in range(mg.n) if b.lay.resident[v]):
            np.testing.assert_array_equal(a.buf(v), b.buf(v))


def test_written_arrays_are_announced_to_the_pinner_of_the_region():
    """``write_arrays`` (a dict, and a ``LazyWeights`` made an array at a time; one tensor of another dtype,
    which goes through ``write_inputs``) tells the pinner of every tile, with the bytes of a write without it."""
    from turnip.compile import compile_model
    from turnip.runtime import open_backend
    from turnip.runtime.loader import write_arrays
    from turnip.runtime.weights import lazy_random_inputs, random_inputs_for

    tg, mg = compile_model("llama-tiny", 64, 1, "1MiB", resident="64KiB")
    arrays = random_inputs_for(tg, 3)
    arrays["L0.wq"] = arrays["L0.wq"].astype(np.float64)  # not the compute dtype: write_inputs takes it
    for make in (lambda: arrays, lambda: lazy_random_inputs(tg, 3)):
        with open_backend("cpu", mg) as a, open_backend("cpu", mg) as b:
            n = write_arrays(a, tg, make())
            drv, region, made = _pinned_while_filled(b)
            assert write_arrays(b, tg, make(), threads=3) == n
            _check_pinned(drv, region, made, b)
            np.testing.assert_array_equal(a.host[0], b.host[0])


def test_a_fill_that_fails_abandons_its_pinner_and_one_that_ends_finishes_it():
    """``pinned_while_filled``: the backend's pinner for the fill's writes, finished when the block ends, abandoned
    (and the error raised) when it fails; None for a backend that pins nothing while it is filled."""
    from turnip.runtime.weights import pinned_while_filled

    class Pinner:
        def __init__(self, writes):
            self.writes, self.ended = writes, []

        def finish(self):
            self.ended.append("finish")

        def abandon(self):
            self.ended.append("abandon")

    class Backend:
        def pin_while_filling(self, writes):
            self.pinner = Pinner(writes)
            return self.pinner

    b = Backend()
    with pinned_while_filled(b, [(0, 8)]) as p:
        assert p is b.pinner and p.writes == [(0, 8)] and p.ended == []
    assert p.ended == ["finish"]
    with pytest.raises(RuntimeError, match="fill failed"), pinned_while_filled(b, [(0, 8)]) as p:
        raise RuntimeError("fill failed")
    assert p.ended == ["abandon"]
    with pinned_while_filled(object(), [(0, 8)]) as p:
        assert p is None
