"""Inputs that `turnip run` and `turnip train` refuse up front, in one `error:` line with exit status 2: a
Hugging Face directory without weights (unless --random-weights), a train --out that is an existing file,
prompt ids outside the vocabulary."""

import json

import numpy as np
import pytest

from tests.clicall import call

pytestmark = pytest.mark.unit

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
          "tie_word_embeddings": False}  # fmt: skip
RUN = ["--budget", "4MiB", "--repeat", "1", "--warmup", "0"]
TRAIN = ["--seq", "16", "--budget", "4MiB", "--steps", "1", "--rank", "2"]


def one_error(rc, out, err, *words):
    assert rc == 2, (rc, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture
def cfg_dir(tmp_path, monkeypatch):
    """A Hugging Face model directory holding only config.json."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf3").mkdir()
    (tmp_path / "hf3" / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path / "hf3"


def test_directory_without_safetensors_needs_random_weights(cfg_dir):
    refused = [["run", "--model", "hf3", "--seq", "16", *RUN], ["run", "--model", "hf3/config.json", "--seq", "16",
               *RUN], ["train", "--model", "hf3", *TRAIN]]  # fmt: skip
    for argv in refused:
        rc, out, err = call(argv)
        one_error(rc, out, err, "hf3", "no safetensors weights", "--random-weights")
        assert "next token" not in out and "step" not in out
    rc, out, err = call(["run", "--model", "hf3", "--seq", "16", "--random-weights", *RUN])
    assert rc == 0 and "next token" in out and "random weights" in err, (out, err)
    rc, out, err = call(["train", "--model", "hf3", "--random-weights", *TRAIN, "--out", "ad"])
    assert rc == 0 and (cfg_dir.parent / "ad" / "adapter_config.json").is_file(), (out, err)


def test_presets_still_run_on_random_weights(cfg_dir):
    rc, out, err = call(["run", "--model", "llama-tiny", "--seq", "16", "--logits", "last", *RUN])
    assert rc == 0 and "next token" in out and "random weights" not in err, (out, err)


def test_train_out_that_is_an_existing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.tplan").write_text("keep")
    rc, out, err = call(["train", "--model", "llama-tiny", *TRAIN, "--out", "tiny.tplan"])
    one_error(rc, out, err, "--out tiny.tplan", "not a directory")
    assert "step" not in out, "refused before training"
    assert (tmp_path / "tiny.tplan").read_text() == "keep"


def test_prompt_ids_outside_the_vocabulary(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "oor.npy", np.array([1, 2, 999, 3, 70]))
    rc, out, err = call(["run", "--prompt-ids", "oor.npy", *RUN])  # llama-tiny: vocabulary of 64
    one_error(rc, out, err, "--prompt-ids oor.npy", "id 999 at position 2", "64")
    assert call(["compile", "--model", "llama-tiny", "--seq", "5", "--budget", "4MiB", "-o", "p.tplan"])[0] == 0
    rc, out, err = call(["run", "p.tplan", "--prompt-ids", "oor.npy", *RUN[2:]])  # a plan: its taskgraph's model
    one_error(rc, out, err, "--prompt-ids oor.npy", "id 999 at position 2", "64")
    np.save(tmp_path / "ok.npy", np.array([1, 2, 63, 3, 0]))
    assert call(["run", "--prompt-ids", "ok.npy", *RUN])[0] == 0


def test_a_plan_file_fixes_what_compile_flags_would_set(cfg_dir):
    """`run PLAN` with flags that only shape a compile is refused; a plan compiled from a model directory runs
    on random weights with a note saying so; --random-weights beside a directory that has weights is refused."""
    from turnip.runtime.weights import write_safetensors

    assert call(["compile", "--model", "hf3", "--seq", "16", "--budget", "4MiB", "-o", "p.tplan"])[0] == 0
    rc, out, err = call(["run", "p.tplan", "--seq", "999", "--rank", "8", "--repeat", "1"])
    one_error(rc, out, err, "--seq, --rank: p.tplan is a compiled plan")
    rc, out, err = call(["run", "p.tplan", "--repeat", "1", "--warmup", "0"])
    assert rc == 0 and "p.tplan holds no weights; running on seeded random weights" in err, err
    write_safetensors(cfg_dir / "model.safetensors", {"model.norm.weight": np.ones(64, np.float16)})
    rc, out, err = call(["run", "--model", "hf3", "--seq", "16", "--random-weights", *RUN])
    one_error(rc, out, err, "--random-weights: hf3 has safetensors weights")
