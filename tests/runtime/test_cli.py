"""``turnip run`` on the CPU backend."""

import pytest

from turnip.cli import main

pytestmark = pytest.mark.cpu_runtime


def test_run_tiny_llama_on_cpu(tmp_path, capsys):
    csv, trace = tmp_path / "runs.csv", tmp_path / "run.json"
    rc = main(["run", "--model", "llama-tiny", "--seq", "64", "--budget", "64KiB", "--dtype", "fp32",
               "--backend", "cpu", "--repeat", "2", "--chaos", "0.2", "--check", "--csv", str(csv),
               "--trace", str(trace)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    for what in ("time to first token", "bytes moved", "GPU busy fraction", "lower bound", "check"):
        assert what in out
    assert len(csv.read_text().splitlines()) == 3 and trace.stat().st_size > 0


def test_run_with_weights_file(tmp_path, capsys):
    from turnip.models import llama_prefill
    from turnip.runtime.weights import random_inputs_for, write_safetensors

    w = random_inputs_for(llama_prefill("tiny", 64), 7)
    write_safetensors(tmp_path / "w.safetensors", {k: v for k, v in w.items() if k != "ids"})
    rc = main(["run", "--model", "llama-tiny", "--budget", "1MiB", "--weights", str(tmp_path / "w.safetensors"),
               "--repeat", "1", "--warmup", "0", "--check"])  # fmt: skip
    assert rc == 0, capsys.readouterr().out
