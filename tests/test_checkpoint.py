"""Hugging Face model directories: write, read back (sharded or not, fp16/bf16/fp32), gather x0, errors."""

import json
import re
import tracemalloc
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import turnip.checkpoint as cp
from turnip.checkpoint import Checkpoint, CheckpointError, MissingTensorError, has_weights, write_checkpoint
from turnip.runtime.weights import NP_OF, hf_name, hf_shape

pytestmark = pytest.mark.unit

D, H, HK, E, F, V, SEQ = 16, 4, 2, 4, 24, 40, 6
CONFIG = {"model_type": "llama", "hidden_size": D, "num_attention_heads": H, "num_key_value_heads": HK,
          "intermediate_size": F, "num_hidden_layers": 2, "vocab_size": V}  # fmt: skip


def shapes(layers: int = 2, head: str = "lm_head") -> dict:
    """Logical inputs of a small grouped-query LLaMA, as the model builder names and shapes them."""
    out = {"x0": (SEQ, D)}
    for i in range(layers):
        out |= {f"L{i}.attn_norm": (D,), f"L{i}.wq": (HK, H // HK, E, D), f"L{i}.wk": (HK, E, D),
                f"L{i}.wv": (HK, E, D), f"L{i}.wo": (D, HK, H // HK, E), f"L{i}.ffn_norm": (D,),
                f"L{i}.w_gate": (F, D), f"L{i}.w_up": (F, D), f"L{i}.w_down": (D, F)}  # fmt: skip
    return out | {"final_norm": (D,), head: (V, D)}


def fake_tg(shp: dict, dtype: str = "fp16", embed: bool = True):
    """What ``iter_inputs`` reads of a taskgraph: meta input_blocks / embed, and the inputs' dtypes."""
    blocks = {n: (s, [((0,) * len(s), i)]) for i, (n, s) in enumerate(shp.items())}
    meta = {"input_blocks": blocks}
    if embed:
        meta["embed"] = {"input": "x0", "table": "model.embed_tokens.weight"}
    return SimpleNamespace(meta=meta, dtype=[dtype] * len(shp))


def hf_tensors(shp: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32)}
    for k, s in shp.items():
        if k != "x0":
            out[hf_name(k)] = rng.standard_normal(hf_shape(k, s)).astype(np.float32)
    return out


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, ValueError), msg
    return msg


@pytest.mark.parametrize("disk", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("compute", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("shard_nbytes", [None, 3000])
def test_round_trip_converts_to_the_compute_dtype(tmp_path, disk, compute, shard_nbytes):
    shp = shapes()
    hf = hf_tensors(shp)
    write_checkpoint(tmp_path / "m", CONFIG, hf, shard_nbytes=shard_nbytes, dtype=disk)
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["m"], "no temporary directory is left behind"
    ck = Checkpoint(tmp_path / "m")
    assert ck.config == CONFIG and set(ck.tensor_names) == set(hf)
    stored = {k: v.astype(NP_OF[disk]) for k, v in hf.items()}
    if shard_nbytes is None:
        assert files == ["config.json", "model.safetensors"] and ck.index is None
    else:
        n = len(files) - 2
        assert n > 2 and files[1] == f"model-00001-of-{n:05d}.safetensors" and files[-1] == cp.INDEX
        index = json.loads((tmp_path / "m" / cp.INDEX).read_text())
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in stored.values())
        assert set(index["weight_map"]) == set(hf) and set(index["weight_map"].values()) == set(files[1:-1])
        assert all(ck.header(k).file.name == f for k, f in index["weight_map"].items())
    code = {"fp16": "F16", "bf16": "BF16", "fp32": "F32"}[disk]
    for k, v in stored.items():
        h = ck.header(k)
        assert (h.dtype, h.shape) == (code, v.shape)
        x = ck.read(k)
        assert x.dtype == v.dtype and np.array_equal(x.view(np.uint8), v.view(np.uint8))
    ids = np.array([3, 0, 39, 3, 7, 8])
    got = list(ck.iter_inputs(fake_tg(shp, compute), ids))
    assert [k for k, _ in got] == sorted(shp, key=lambda k: _position(ck, k)), "read in file order"
    for k, x in got:
        src = stored["model.embed_tokens.weight"][ids] if k == "x0" else stored[hf_name(k)]
        want = src.astype(np.float32).astype(NP_OF[compute]).reshape(shp[k])
        assert x.dtype == np.dtype(NP_OF[compute]) and x.shape == shp[k]
        assert np.array_equal(x.view(np.uint8), want.view(np.uint8)), k


def _position(ck, k):
    h = ck.header("model.embed_tokens.weight" if k == "x0" else hf_name(k))
    return ck.files.index(h.file), h.offset


def test_a_single_safetensors_file_and_our_names(tmp_path):
    """A .safetensors file path is a checkpoint too (no config); turnip's own names load, x0 included."""
    shp = shapes(1, head="tok_embed")
    rng = np.random.default_rng(1)
    ours = {k: rng.standard_normal(s).astype(np.float16) for k, s in shp.items()}
    write_checkpoint(tmp_path / "m", {}, ours)
    ck = Checkpoint(tmp_path / "m" / "model.safetensors")
    assert ck.config is None and ck.index is None and ck.tensor_names == list(ours)
    got = dict(ck.iter_inputs(fake_tg(shp)))
    assert all(np.array_equal(got[k], ours[k]) for k in ours)
    ids = np.arange(SEQ)
    assert np.array_equal(dict(ck.iter_inputs(fake_tg(shp), ids))["x0"], ours["tok_embed"][ids])


def test_read_rows_reads_only_those_rows(tmp_path, monkeypatch):
    table = np.arange(V * D, dtype=np.float32).reshape(V, D).astype(ml_dtypes.bfloat16)
    write_checkpoint(tmp_path / "m", CONFIG, {"model.embed_tokens.weight": table})
    ck = Checkpoint(tmp_path / "m")
    reads = []
    real_open = cp._open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, n):
            self.f.seek(n)

        def readinto(self, b):
            n = self.f.readinto(b)
            reads.append(n)
            return n

    monkeypatch.setattr(cp, "_open", lambda file: Counting(real_open(file)))
    ids = np.array([[5, 3, 3], [4, 39, 0]])
    rows = ck.read_rows("model.embed_tokens.weight", ids)
    assert rows.dtype == ml_dtypes.bfloat16 and rows.shape == (2, 3, D) and np.array_equal(rows, table[ids])
    assert reads == [D * 2, 3 * D * 2, D * 2], "one read per run of consecutive rows (0; 3-5; 39), nothing else"
    with pytest.raises(CheckpointError) as e:
        ck.read_rows("model.embed_tokens.weight", [1, 40])
    assert "id 40 at position 1 is outside [0, 40)" in one_line(e)


def test_x0_gathers_rows_of_the_ids(tmp_path):
    shp = shapes(1)
    hf = hf_tensors(shp)
    write_checkpoint(tmp_path / "m", CONFIG, hf, dtype="bf16")
    ck = Checkpoint(tmp_path / "m")
    tg = fake_tg(shp, "fp32")
    table = hf["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16).astype(np.float32)
    x0 = dict(ck.iter_inputs(tg, seed=4))["x0"]  # no ids: random ids of the seed
    assert all((row == table).all(axis=1).any() for row in x0)
    assert np.array_equal(x0, dict(ck.iter_inputs(tg, seed=4))["x0"])
    assert not np.array_equal(x0, dict(ck.iter_inputs(tg, seed=5))["x0"])
    for ids, match in [
        (np.arange(SEQ + 1), r"7 token ids .*'x0' takes 6 \(the taskgraph's sequence length\)"),
        (np.array([0, 1, 2, 3, 4, V]), r"id 40 at position 5 is outside \[0, 40\)"),
        (np.array([0, -1, 2, 3, 4, 5]), r"id -1 at position 1 is outside \[0, 40\)"),
        (np.zeros(SEQ), "ids must be integers"),
    ]:
        with pytest.raises(CheckpointError) as e:
            next(ck.iter_inputs(tg, ids))
        assert re.search(match, one_line(e)), str(e.value)
    with pytest.raises(CheckpointError, match="no embedded input"):
        next(ck.iter_inputs(fake_tg({"L0.w_up": (F, D)}, embed=False), np.arange(SEQ)))


def test_tied_embeddings_serve_as_the_head(tmp_path):
    shp = shapes(1, head="lm_head")
    hf = hf_tensors(shp)
    del hf["lm_head.weight"]
    write_checkpoint(tmp_path / "m", CONFIG | {"tie_word_embeddings": True}, hf)
    got = dict(Checkpoint(tmp_path / "m").iter_inputs(fake_tg(shp, "fp32"), np.arange(SEQ)))
    assert np.array_equal(got["lm_head"], hf["model.embed_tokens.weight"])
    got = dict(Checkpoint(tmp_path / "m").iter_inputs(fake_tg(shapes(1, head="tok_embed"), "fp32"), np.arange(SEQ)))
    assert np.array_equal(got["tok_embed"], hf["model.embed_tokens.weight"])


def raw_safetensors(path, entries) -> None:
    """A safetensors file from (name, dtype code, shape, data bytes) entries, codes unchecked."""
    header, off = {}, 0
    for name, code, shape, data in entries:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(e[3] for e in entries))


def test_every_problem_is_one_line_naming_what_is_wrong(tmp_path):
    shp = shapes()
    tg = fake_tg(shp)

    def model(name, hf=None, **kw):
        write_checkpoint(tmp_path / name, CONFIG, hf if hf is not None else hf_tensors(shp), **kw)
        return tmp_path / name

    def error(path, iterate=True, cls=CheckpointError) -> str:
        with pytest.raises(cls) as e:
            list(Checkpoint(path).iter_inputs(tg, np.arange(SEQ))) if iterate else Checkpoint(path)
        return one_line(e)

    hf = hf_tensors(shp)
    del hf["model.layers.1.mlp.up_proj.weight"]
    msg = error(model("missing", hf, shard_nbytes=3000), cls=MissingTensorError)
    assert all(s in msg for s in ("'model.layers.1.mlp.up_proj.weight'", "turnip's 'L1.w_up'", "(24, 16)",
                                  cp.INDEX, "model-00001-of-")), msg  # fmt: skip
    assert isinstance(MissingTensorError("x"), KeyError) and str(MissingTensorError("a b")) == "a b"

    hf = hf_tensors(shp) | {"model.layers.0.self_attn.q_proj.weight": np.zeros((8, 32), np.float32)}
    msg = error(model("shape", hf))
    assert all(s in msg for s in ("model.safetensors", "'model.layers.0.self_attn.q_proj.weight'", "(for L0.wq)",
                                  "shape (8, 32) (256 elements)", "expects (16, 16) (256 elements)")), msg  # fmt: skip

    p = model("short", shard_nbytes=3000)
    last = sorted(p.glob("model-*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-10])
    msg = error(p, iterate=False)
    assert last.name in msg and "truncated" in msg and "incomplete download" in msg, msg

    p = model("garbage")
    (p / "model.safetensors").write_bytes(b"this is not a safetensors file at all")
    assert "not a safetensors file" in error(p, iterate=False)

    p = model("shard", shard_nbytes=3000)
    second = sorted(p.glob("model-*.safetensors"))[1]
    second.unlink()
    msg = error(p, iterate=False)
    assert f"shard {second.name} is missing" in msg and cp.INDEX in msg and "more tensors" in msg, msg

    p = model("index", shard_nbytes=3000)
    index = json.loads((p / cp.INDEX).read_text())
    first = sorted(p.glob("model-*.safetensors"))[0].name
    (p / cp.INDEX).write_text(json.dumps(index | {"weight_map": index["weight_map"] | {"ghost": first}}))
    assert f"maps 'ghost' to {first}, whose header has no such tensor" in error(p, iterate=False)
    (p / cp.INDEX).write_text("{not json")
    assert "cannot read the index" in error(p, iterate=False)

    p = model("dtypes")
    f8 = ("model.layers.0.input_layernorm.weight", "F8_E4M3", (D,), bytes(D))
    i32 = ("model.layers.0.post_attention_layernorm.weight", "I32", (D,), bytes(4 * D))
    raw_safetensors(p / "weird.safetensors", [f8, i32])
    with pytest.raises(CheckpointError) as e:
        Checkpoint(p / "weird.safetensors").read(f8[0])
    assert "dtype F8_E4M3, which turnip cannot read" in one_line(e)
    with pytest.raises(CheckpointError) as e:
        next(Checkpoint(p / "weird.safetensors").iter_inputs(fake_tg({"L0.ffn_norm": (D,)}, embed=False)))
    assert "'model.layers.0.post_attention_layernorm.weight' (for L0.ffn_norm) has dtype I32" in one_line(e)

    big = hf_tensors(shp)
    big["model.norm.weight"][3] = 1e6
    assert "beyond fp16's 65504" in error(model("big", big, dtype="bf16"))

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"pickle")
    msg = error(tmp_path / "bin", iterate=False)
    assert "pytorch_model.bin" in msg and "convert to safetensors" in msg, msg
    (tmp_path / "empty").mkdir()
    assert "no model.safetensors or model.safetensors.index.json" in error(tmp_path / "empty", iterate=False)
    assert "no such file or directory" in error(tmp_path / "nowhere", iterate=False)
    with pytest.raises(MissingTensorError, match="no tensor 'nope'"):
        Checkpoint(model("plain")).read("nope")


def test_iterating_holds_about_one_tensor_and_its_converted_copy(tmp_path):
    """Reading 8 tensors (bf16 on disk, fp16 compute: converted through float32 chunks) never holds more
    than a tensor, its converted copy and one chunk per conversion thread; without a conversion, one
    tensor."""
    shp = {f"L{i}.w_up": (1024, 1024) for i in range(8)}
    rng = np.random.default_rng(0)
    write_checkpoint(tmp_path / "m", {}, {hf_name(k): rng.standard_normal(s, np.float32) for k, s in shp.items()},
                     shard_nbytes=5 << 20, dtype="bf16")  # fmt: skip
    ck = Checkpoint(tmp_path / "m")
    tensor = 1024 * 1024 * 2
    for compute, bound in (("fp16", 2 * tensor + cp.CONVERT_THREADS * cp.CHUNK_ELEMS * 4), ("bf16", tensor)):
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            n = 0
            for _name, x in ck.iter_inputs(fake_tg(shp, compute, embed=False)):
                n += x.nbytes
                del x
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert n == 8 * tensor and peak <= bound + (256 << 10), (compute, peak / tensor)


def test_write_checkpoint_replaces_a_directory_only_when_asked(tmp_path):
    hf = {"model.norm.weight": np.ones(D, np.float32)}
    (tmp_path / "m").mkdir()
    write_checkpoint(tmp_path / "m", CONFIG, hf)  # an empty directory is fine
    with pytest.raises(CheckpointError, match="not an empty directory; pass overwrite=True"):
        write_checkpoint(tmp_path / "m", CONFIG, hf)
    (tmp_path / "m" / "stale.txt").write_text("old")
    write_checkpoint(tmp_path / "m", CONFIG, {"model.norm.weight": np.zeros(D, np.float16)}, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    assert Checkpoint(tmp_path / "m").header("model.norm.weight").dtype == "F16"
    with pytest.raises(ValueError, match="no safetensors code"):
        write_checkpoint(tmp_path / "bad", CONFIG, hf | {"c": np.zeros(2, np.complex64)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"], "a failed write leaves nothing behind"


def test_only_some_inputs_and_has_weights(tmp_path):
    shp = shapes(1)
    hf = hf_tensors(shp)
    p = write_checkpoint(tmp_path / "m", CONFIG, hf, shard_nbytes=3000)
    ck = Checkpoint(p)
    got = list(ck.iter_inputs(fake_tg(shp, "fp32"), ids=np.arange(SEQ), only=("x0", "L0.wk")))
    assert [k for k, _ in got] == sorted(["x0", "L0.wk"], key=lambda k: _position(ck, k))
    assert np.array_equal(dict(got)["x0"], hf["model.embed_tokens.weight"][:SEQ])
    with pytest.raises(CheckpointError, match="'wq' is not a logical input"):
        next(ck.iter_inputs(fake_tg(shp), only=("wq",)))
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{}")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    assert has_weights(p) and has_weights(next(p.glob("model-*.safetensors"))) and has_weights(tmp_path / "bin")
    assert not has_weights(tmp_path / "cfg") and not has_weights(tmp_path / "cfg" / "config.json")
    assert not has_weights(tmp_path / "nowhere")
