"""Plan files: round trip, and clear errors for corrupted or foreign files."""

import json

import numpy as np
import pytest

from turnip.memgraph.build import build_memgraph
from turnip.memgraph.io import PlanFormatError, _checksum, load_plan, save_plan
from turnip.memgraph.verify import verify
from turnip.models import llama_prefill, matmul_example

pytestmark = pytest.mark.unit


def test_round_trip(tmp_path):
    tg = llama_prefill("tiny", seq=16, n_gpus=2, dtype="fp16")
    mg = build_memgraph(tg, 30_000)
    p = tmp_path / "plan.tplan"
    save_plan(p, mg, tg)
    mg2, tg2 = load_plan(p)
    for k in ("kind", "gpu", "out_offset", "in_idx", "dep_src", "dep_kind", "lock_group", "outputs"):
        np.testing.assert_array_equal(getattr(mg, k), getattr(mg2, k))
    assert mg2.op == mg.op and mg2.shape == mg.shape and mg2.params == mg.params
    assert tg2.name == tg.name and tg2.n == tg.n
    assert verify(mg2, tg2) == []


def test_corrupted_file(tmp_path):
    tg = matmul_example()
    p = tmp_path / "plan.tplan"
    save_plan(p, build_memgraph(tg, 4 * 256), tg)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(PlanFormatError, match="corrupted"):
        load_plan(p)
    p.write_text("hello")
    with pytest.raises(PlanFormatError, match="not a turnip plan"):
        load_plan(p)
    with pytest.raises(PlanFormatError, match="cannot read"):
        load_plan(tmp_path / "missing.tplan")


def test_wrong_version(tmp_path):
    tg = matmul_example()
    p = tmp_path / "plan.tplan"
    save_plan(p, build_memgraph(tg, 5 * 256), tg)
    with np.load(p) as z:
        arrays = {k: z[k] for k in z.files}
    h = json.loads(arrays["header"].tobytes())
    h["version"] = 99
    arrays["header"] = np.frombuffer(json.dumps(h).encode(), dtype=np.uint8)
    del arrays["checksum"]
    arrays["checksum"] = _checksum(arrays)  # a well-formed file of another version
    with open(p, "wb") as f:
        np.savez(f, **arrays)
    with pytest.raises(PlanFormatError, match="version 99"):
        load_plan(p)


def test_failed_save_leaves_nothing(tmp_path):
    class Boom(dict):
        def items(self):
            raise RuntimeError("boom")

    tg = matmul_example()
    mg = build_memgraph(tg, 5 * 256)
    mg.stats = Boom()
    with pytest.raises(RuntimeError):
        save_plan(tmp_path / "x.tplan", mg, tg)
    assert list(tmp_path.iterdir()) == []
