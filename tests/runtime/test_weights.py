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
