"""Weights: random logical inputs, the numpy safetensors reader, Hugging Face names and layouts."""

import numpy as np
import pytest

from turnip.models import llama_prefill
from turnip.runtime.weights import (
    from_hf,
    hf_name,
    load_weights,
    random_inputs_for,
    read_safetensors,
    tile_inputs,
    write_safetensors,
)

pytestmark = pytest.mark.cpu_runtime


def test_random_inputs_cover_every_tile():
    tg = llama_prefill("tiny", 64)
    w = random_inputs_for(tg, 3)
    assert w["ids"].dtype == np.int32 and w["ids"].max() < 64
    assert abs(float(w["L0.wq"].astype(np.float32).std()) - 0.02) < 0.005
    tiles = tile_inputs(tg, w)
    assert set(tiles) == set(np.flatnonzero(tg.kind == 0).tolist())
    assert np.array_equal(random_inputs_for(tg, 3)["L1.w_up"], w["L1.w_up"])


def test_safetensors_round_trip(tmp_path):
    xs = {"a": np.arange(6, dtype=np.float16).reshape(2, 3), "b": np.array([1, 2], dtype=np.int32)}
    write_safetensors(tmp_path / "x.safetensors", xs)
    back = read_safetensors(tmp_path / "x.safetensors")
    assert set(back) == {"a", "b"} and all(np.array_equal(back[k], xs[k]) for k in xs)


def test_bf16_is_read_as_float32(tmp_path):
    import json

    vals = np.array([1.5, -2.0], dtype=np.float32)
    raw = (vals.view(np.uint32) >> 16).astype("<u2").tobytes()
    h = json.dumps({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "b.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + raw)
    assert np.array_equal(read_safetensors(tmp_path / "b.safetensors")["w"], vals)


def test_hugging_face_names_and_layouts(tmp_path):
    tg = llama_prefill("tiny", 64)
    ours = {k: v for k, v in random_inputs_for(tg, 0).items() if k != "ids"}
    d, H = 64, 4
    hf = {}
    for k, v in ours.items():
        what = k.split(".", 1)[-1]
        if what in ("wq", "wk", "wv"):
            hv = v.reshape(d, -1).T  # (H*e, d) like q_proj.weight
        elif what == "wo":
            hv = v.reshape(-1, d).T  # (d, H*e) like o_proj.weight
        elif what.startswith("w_"):
            hv = v.T
        else:
            hv = v
        hf[hf_name(k)] = np.ascontiguousarray(hv)
        assert np.array_equal(from_hf(k, hf[hf_name(k)], H), v)
    assert hf_name("L1.wq") == "model.layers.1.self_attn.q_proj.weight"
    write_safetensors(tmp_path / "hf.safetensors", hf)
    got = load_weights(tg, tmp_path / "hf.safetensors", H)
    assert all(np.array_equal(got[k], ours[k]) for k in ours)
    write_safetensors(tmp_path / "ours.safetensors", ours)
    got = load_weights(tg, tmp_path / "ours.safetensors", H)
    assert all(np.array_equal(got[k], ours[k]) for k in ours)


def test_streamed_weights_equal_the_dict_of_weights(tmp_path):
    """write_streaming fills the host input region exactly as write_inputs of all tiles at once, from random
    weights and from a Hugging Face-named safetensors file read one tensor at a time."""
    from turnip.compile import build_with_resident
    from turnip.runtime import open_backend
    from turnip.runtime.weights import hf_name, iter_random_inputs, iter_weights, write_streaming

    tg = llama_prefill("tiny", 64)
    mg = build_with_resident(tg, 1 << 20)
    w = random_inputs_for(tg, 5)
    with open_backend("cpu", mg) as a, open_backend("cpu", mg) as b:
        a.write_inputs(tile_inputs(tg, w))
        assert write_streaming(b, tg, iter_random_inputs(tg, 5)) == sum(x.nbytes for x in w.values())
        np.testing.assert_array_equal(a.host[0], b.host[0])
    hf = {}
    for name, x in w.items():
        if name == "ids":
            continue
        what = name.split(".", 1)[-1]
        if what in ("wq", "wk", "wv"):
            x = x.reshape(x.shape[0], -1).T
        elif what == "wo":
            x = x.reshape(-1, x.shape[-1]).T
        elif what in ("w_gate", "w_up", "w_down"):
            x = x.T
        hf[hf_name(name)] = np.ascontiguousarray(x)
    write_safetensors(tmp_path / "hf.safetensors", hf)
    with open_backend("cpu", mg) as a, open_backend("cpu", mg) as b:
        a.write_inputs(tile_inputs(tg, w))
        b.write_inputs(tile_inputs(tg, {"ids": w["ids"]}))
        write_streaming(b, tg, iter_weights(tg, tmp_path / "hf.safetensors", 4))
        np.testing.assert_array_equal(a.host[0], b.host[0])


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
    assert ratio["dict"] >= 1.6, ratio  # the check can tell the two apart
