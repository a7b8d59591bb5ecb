"""Hugging Face LLaMA-family models: configs to taskgraphs, checkpoints to logits, against a plain numpy
LLaMA (``tests/test_models.py``), on the CPU backend and through ``turnip run --model DIR``."""

import json

import numpy as np
import pytest

from tests.test_models import numpy_llama
from turnip.models import LlamaConfig, load_config

pytestmark = pytest.mark.unit

GQA = {  # a LLaMA-3-style config as transformers writes it (rope_parameters, GQA, tied embeddings)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 517, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}  # fmt: skip


def hf_tensors(cfg: LlamaConfig, rng) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face names and shapes (2-D projections, (out, in))."""
    d, e, H, Hk, f = cfg.d_model, cfg.dh, cfg.n_heads, cfg.kv_heads, cfg.d_ffn
    t = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab, d)) * 0.5,
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(d)}  # fmt: skip
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = rng.standard_normal((cfg.vocab, d)) * 0.2
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": 1 + 0.1 * rng.standard_normal(d),
              p + "post_attention_layernorm.weight": 1 + 0.1 * rng.standard_normal(d),
              p + "self_attn.q_proj.weight": rng.standard_normal((H * e, d)) * 0.2,
              p + "self_attn.k_proj.weight": rng.standard_normal((Hk * e, d)) * 0.2,
              p + "self_attn.v_proj.weight": rng.standard_normal((Hk * e, d)) * 0.2,
              p + "self_attn.o_proj.weight": rng.standard_normal((d, H * e)) * 0.2,
              p + "mlp.gate_proj.weight": rng.standard_normal((f, d)) * 0.2,
              p + "mlp.up_proj.weight": rng.standard_normal((f, d)) * 0.2,
              p + "mlp.down_proj.weight": rng.standard_normal((d, f)) * 0.2}  # fmt: skip
    return {k: v.astype(np.float32) for k, v in t.items()}


def ours(t: dict, cfg: LlamaConfig) -> dict:
    """Our logical names over the same tensors (numpy_llama reshapes them itself)."""
    w = {"final_norm": t["model.norm.weight"], "tok_embed": t["model.embed_tokens.weight"]}
    if "lm_head.weight" in t:
        w["lm_head"] = t["lm_head.weight"]
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "wq": "self_attn.q_proj",
             "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}  # fmt: skip
    for i in range(cfg.n_layers):
        w |= {f"L{i}.{k}": t[f"model.layers.{i}.{v}.weight"] for k, v in names.items()}
    return w


@pytest.fixture
def model_dir(tmp_path):
    from turnip.checkpoint import write_checkpoint

    cfg = LlamaConfig.from_hf(GQA)
    t = hf_tensors(cfg, np.random.default_rng(3))
    d = tmp_path / "tiny-llama3"
    write_checkpoint(d, GQA, t, shard_nbytes=40_000, dtype="bf16")  # sharded, bf16 on disk
    return d, cfg, t


def test_config_from_transformers_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GQA))
    c = load_config(tmp_path)
    assert (c.d_model, c.n_heads, c.kv_heads, c.group, c.dh, c.vocab) == (64, 8, 2, 4, 16, 517)
    assert c.rope_scaling == (8.0, 1.0, 4.0, 64.0) and c.rope_theta == 500000.0 and c.tie_embeddings
    old = {k: v for k, v in GQA.items() if k != "rope_parameters"} | {"rope_theta": 1e6, "rope_scaling": None}
    assert LlamaConfig.from_hf(old).rope_scaling == () and LlamaConfig.from_hf(old).rope_theta == 1e6


@pytest.mark.parametrize("change,msg", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"mlp_bias": True}, "no biases"),
    ({"hidden_act": "gelu"}, "hidden_act .gelu. is not supported"),
    ({"num_key_value_heads": 3}, "not a multiple of 3"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"vocab_size": None}, "'vocab_size'"),
])  # fmt: skip
def test_configs_turnip_cannot_run_are_named(change, msg):
    with pytest.raises(ValueError, match=msg):
        LlamaConfig.from_hf(GQA | change)


@pytest.mark.parametrize("gpus,head,dtype,split", [(1, "last", "fp32", "tensor"), (2, "last", "fp32", "tensor"),
                                                   (2, "all", "fp32", "tensor"), (1, "last", "bf16", "tensor"),
                                                   (2, "all", "fp32", "data")])  # fmt: skip
def test_checkpoint_logits_match_numpy_on_the_cpu_backend(model_dir, gpus, head, dtype, split):
    from turnip.checkpoint import Checkpoint
    from turnip.compile import build_with_resident, make_taskgraph
    from turnip.memgraph.interp import assemble
    from turnip.memgraph.verify import verify
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import write_streaming

    d, cfg, t = model_dir
    ids = np.random.default_rng(5).integers(0, cfg.vocab, size=37)
    budget = 200_000  # below the embedding table (517 x 64 fp32 = 132 KB) plus one layer: streamed, tiled head
    tg = make_taskgraph(str(d), 37, gpus, dtype, {"t": 16, "v": 130}, budget_nbytes=budget, head=head, split=split)
    mg = build_with_resident(tg, budget)
    assert verify(mg, tg) == []
    with open_backend("cpu", mg, 3, chaos=0.3) as be:
        write_streaming(be, tg, Checkpoint(d).iter_inputs(tg, ids=ids))
        execute(mg, be, "nondet", 3, seed=1)
        got = assemble(tg, be.read_outputs(), "logits").astype(np.float64)
    import ml_dtypes

    w = {k: v.astype(ml_dtypes.bfloat16).astype(np.float64) for k, v in ours(t, cfg).items()}  # bf16 on disk
    want = numpy_llama(w, w["tok_embed"][ids], cfg, head)
    tol = 5e-4 if dtype == "fp32" else 3e-2
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
    assert got[-1].argmax() == want[-1].argmax()


def test_turnip_run_prints_the_next_token(model_dir, tmp_path, capsys):
    from turnip.cli import main

    d, cfg, t = model_dir
    ids = np.random.default_rng(7).integers(0, cfg.vocab, size=21)
    np.save(tmp_path / "ids.npy", ids)
    rc = main(["run", "--model", str(d), "--prompt-ids", str(tmp_path / "ids.npy"), "--dtype", "fp32",
               "--budget", "1MiB", "--repeat", "1", "--warmup", "0", "--check"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    import ml_dtypes

    w = {k: v.astype(ml_dtypes.bfloat16).astype(np.float64) for k, v in ours(t, cfg).items()}
    want = numpy_llama(w, w["tok_embed"][ids], cfg, "last")[-1]
    line = next(x for x in out.splitlines() if x.startswith("next token"))
    assert int(line.split()[2]) == int(want.argmax())
    top = next(x for x in out.splitlines() if x.startswith("top-5 logits"))
    assert top.split()[2] == str(int(want.argmax())) and len(top.split(",")) == 5


def test_run_errors_name_the_problem(model_dir, tmp_path, capsys):
    from turnip.cli import main

    d, _cfg, _t = model_dir
    assert main(["run", "--model", str(d), "--prompt", "hello"]) == 2  # no tokenizer.json in the directory
    assert "tokenizer.json" in capsys.readouterr().err
    np.save(tmp_path / "bad.npy", np.array([1, 2, 10_000]))
    assert main(["run", "--model", str(d), "--prompt-ids", str(tmp_path / "bad.npy"), "--repeat", "1"]) != 0
    err = capsys.readouterr().err
    assert "10000" in err and "517" in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", str(tmp_path / "nowhere")])
    assert e.value.code == 2 and "neither a preset" in capsys.readouterr().err


def test_prompt_text_through_the_directory_tokenizer(model_dir, capsys):
    pytest.importorskip("tokenizers", reason="--prompt uses the optional tokenizers package")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from turnip.cli import main

    d, cfg, t = model_dir
    tok = Tokenizer(models.WordLevel({"[UNK]": 0} | {f"w{i}": i for i in range(1, cfg.vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    rc = main(["run", "--model", str(d), "--prompt", "w5 w300 w7 w9", "--dtype", "fp32", "--repeat", "1",
               "--warmup", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    import ml_dtypes

    w = {k: v.astype(ml_dtypes.bfloat16).astype(np.float64) for k, v in ours(t, cfg).items()}
    want = int(numpy_llama(w, w["tok_embed"][[5, 300, 7, 9]], cfg, "last")[-1].argmax())
    line = next(x for x in out.splitlines() if x.startswith("next token"))
    assert line.split()[2] == str(want) and f"'w{want}'" in line  # the id and its text


def test_train_on_a_checkpoint_with_text_data(model_dir, capsys, tmp_path):
    """`turnip train --model DIR --data text.txt`: frozen weights from the checkpoint, the text tokenized with
    the directory's tokenizer.json, adapters saved in PEFT's layout."""
    pytest.importorskip("tokenizers", reason="text data uses the optional tokenizers package")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from turnip.checkpoint import Checkpoint
    from turnip.cli import main

    d, cfg, _ = model_dir
    tok = Tokenizer(models.WordLevel({"[UNK]": 0} | {f"w{i}": i for i in range(1, cfg.vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (tmp_path / "text.txt").write_text(" ".join(f"w{(7 * i) % cfg.vocab}" for i in range(300)))
    rc = main(["train", "--model", str(d), "--data", str(tmp_path / "text.txt"), "--seq", "16", "--batch", "2",
               "--steps", "3", "--rank", "4", "--dtype", "fp32", "--budget", "4MiB", "--lr", "1e-2",
               "--out", str(tmp_path / "ad")])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    losses = [float(x.split()[3]) for x in out.splitlines() if x.startswith("step ")]
    assert len(losses) == 3 and all(np.isfinite(losses))
    ck = Checkpoint(tmp_path / "ad" / "adapter_model.safetensors")
    names = ck.tensor_names() if callable(ck.tensor_names) else ck.tensor_names
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
