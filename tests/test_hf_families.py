"""Hugging Face decoder families against transformers: random small models made by transformers (no
downloads) and saved, loaded by turnip from the directory, compiled under budgets that offload on 1 and 2
GPUs, every memgraph verified, run on the CPU backend in fp32; the last position's logits against the
model's own (transformers' eager attention). Also: every config field turnip does not run is refused in
one line naming it."""

import numpy as np
import pytest

from turnip.models import LlamaConfig

pytestmark = pytest.mark.cpu_runtime

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 101, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2}  # fmt: skip
W = 8  # the sliding window of the windowed families; prompts of 2 W tokens
FAMILIES = {  # name: (transformers class prefix, config fields beyond SMALL)
    "llama_bias": ("Llama", {"attention_bias": True}),
    "mistral": ("Mistral", {"sliding_window": W}),
    "qwen2": ("Qwen2", {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1}),
    "qwen3": ("Qwen3", {}),
    "phi3": ("Phi3", {"sliding_window": W}),
    "gemma": ("Gemma", {}),
    "gemma2": ("Gemma2", {"sliding_window": W, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
                          "final_logit_softcapping": 5.0}),
}  # fmt: skip


def hf_model(family: str, seed: int = 0, **change):
    """A random transformers model of ``family`` (norm weights near their neutral value, projections large
    enough that scores reach the soft caps) in eval mode, with eager attention."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    prefix, fields = FAMILIES[family]
    cfg = getattr(transformers, prefix + "Config")(**SMALL, **fields | change)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, prefix + "ForCausalLM")(cfg).eval()
    gemma = prefix.startswith("Gemma")  # their norms scale by 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name and not gemma else 0.0
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.2) + base)
    return model


def hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0, -1].double().numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (model directory, transformers model), made once per module."""
    made = {}

    def get(family):
        if family not in made:
            model = hf_model(family)
            d = tmp_path_factory.mktemp(family) / "model"
            model.save_pretrained(d)
            made[family] = d, model
        return made[family]

    return get


def turnip_logits(d, ids, gpus: int, budget: int, tiles: dict) -> tuple[np.ndarray, int]:
    """The last position's logits of the model in ``d`` on the CPU backend (fp32, nondeterministic order)
    and the number of offloads in its verified memgraph."""
    from turnip.checkpoint import Checkpoint
    from turnip.compile import build_with_resident, make_taskgraph
    from turnip.memgraph.interp import assemble
    from turnip.memgraph.plan import KIND_OFFLOAD
    from turnip.memgraph.verify import verify
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import write_streaming

    tg = make_taskgraph(str(d), len(ids), gpus, "fp32", tiles, budget_nbytes=budget, head="last")
    mg = build_with_resident(tg, budget)
    assert verify(mg, tg) == []
    with open_backend("cpu", mg, 3, chaos=0.3) as be:
        write_streaming(be, tg, Checkpoint(d).iter_inputs(tg, ids=ids))
        execute(mg, be, "nondet", 3, seed=1)
        got = assemble(tg, be.read_outputs(), "logits").astype(np.float64)
    return got[-1], int((mg.kind == KIND_OFFLOAD).sum())


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_logits_match_transformers(saved, family, gpus):
    """Token tiles of W / 2 and key ranges of W tokens: the window cuts through ranges (partials merged by
    attn_combine) and drops whole key blocks; 40 KB on one GPU, 20 KB each on two offload (one layer's
    weights are 90 KB)."""
    d, model = saved(family)
    ids = np.random.default_rng(1).integers(3, SMALL["vocab_size"], size=2 * W)
    want = hf_logits(model, ids)
    got, offloads = turnip_logits(d, ids, gpus, 40_000 // gpus, {"t": W // 2, "kv": W, "v": 51})
    assert offloads > 0
    assert np.abs(got - want).max() < 2e-4 * max(1.0, np.abs(want).max()), np.abs(got - want).max()
    assert got.argmax() == want.argmax()


def test_mistral_window_matters_at_twice_the_window(saved):
    """The windowed model's logits differ from the same weights without the window by far more than the
    tolerance above: the comparison above would catch attention past the window."""
    d, model = saved("mistral")
    ids = np.random.default_rng(1).integers(3, SMALL["vocab_size"], size=2 * W)
    full = hf_model("mistral", sliding_window=None)
    full.load_state_dict(model.state_dict())
    assert np.abs(hf_logits(full, ids) - hf_logits(model, ids)).max() > 1e-2


def test_config_fields_become_the_family_variations():
    q2 = LlamaConfig.from_hf({**SMALL, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
                              "max_window_layers": 1})  # fmt: skip
    assert (q2.qkv_bias, q2.o_bias, q2.window, q2.layer_window(0), q2.layer_window(1)) == (True, False, 64, 0, 64)
    assert LlamaConfig.from_hf({**SMALL, "model_type": "qwen2", "sliding_window": 64}).window == 0  # not used
    g2 = LlamaConfig.from_hf({**SMALL, "model_type": "gemma2"})  # transformers' defaults for what is left out
    assert (g2.window, g2.window_layers, g2.attn_softcap, g2.logit_softcap) == (4096, (0,), 50.0, 30.0)
    assert (g2.norm_offset, g2.embed_scale, g2.attn_scale, g2.act, g2.sandwich) == (1.0, 8.0, 1 / 16, "gelu_tanh", True)
    assert LlamaConfig.from_hf({**SMALL, "model_type": "mistral"}).window == 4096
    assert LlamaConfig.from_hf({**SMALL, "model_type": "mistral", "sliding_window": None}).window == 0
    assert LlamaConfig.from_hf({**SMALL, "model_type": "gemma", "hidden_act": "gelu"}).act == "gelu_tanh"
    assert LlamaConfig.from_hf({**SMALL, "model_type": "qwen3"}).qk_norm


@pytest.mark.parametrize("mt,change,msg", [
    ("llama", {"sliding_window": 4096}, "config field 'sliding_window' .4096. is not implemented"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "'quantization_config'"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("mistral", {"attention_bias": True}, "'attention_bias'"),
    ("mistral", {"sliding_window": 0.5}, "sliding_window 0.5"),
    ("qwen2", {"layer_types": ["sliding_attention"] * 2}, "use_sliding_window is false"),
    ("qwen3", {"use_sliding_window": True, "layer_types": ["full", "full"]}, "layer_types"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}}, "rope type 'longrope'"),
    ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
    ("gemma", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("gemma2", {"sliding_window": None}, "sliding_window is not set"),
    ("gemma2", {"final_logit_softcapping": -1}, "final_logit_softcapping"),
    ("mixtral", {}, "model_type 'mixtral' is not supported"),
])  # fmt: skip
def test_fields_turnip_does_not_run_are_refused_in_one_line(mt, change, msg):
    with pytest.raises(ValueError, match=msg) as e:
        LlamaConfig.from_hf({**SMALL, "model_type": mt} | change, name="m")
    assert "\n" not in str(e.value) and str(e.value).startswith("m: ")


def test_lora_training_refuses_the_variations():
    from turnip.train import lora_graph

    cfg = LlamaConfig.from_hf({**SMALL, "model_type": "qwen2"})
    with pytest.raises(ValueError, match="qkv_bias"):
        lora_graph(cfg, 16)


MODEL_TYPES = {"llama_bias": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
               "gemma": "gemma", "gemma2": "gemma2"}  # fmt: skip


@pytest.mark.parametrize("head", ["none", "last", "all"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_estimate_counts_the_family_taskgraph(tmp_path, family, head):
    """``turnip.compile.estimate`` stays exact (it refuses huge compiles before building them)."""
    import json

    from turnip.compile import estimate, make_taskgraph

    cfg = {**SMALL, "model_type": MODEL_TYPES[family], **FAMILIES[family][1], "num_hidden_layers": 3}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for gpus, tiles, split in ((1, {"t": 4, "kv": 8}, "tensor"), (2, {"t": 4, "kv": 12, "v": 40}, "tensor"),
                               (3, {"t": 8, "h": 1}, "tensor"), (2, {"t": 4, "kv": 8}, "layers")):  # fmt: skip
        est = estimate(str(tmp_path), 44, gpus, "fp32", tiles, head=head, split=split)
        assert est.vertices == make_taskgraph(str(tmp_path), 44, gpus, "fp32", tiles, head=head, split=split,
                                             fold=False).n


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_logits_match_numpy(tmp_path, family, gpus):
    """Without transformers: the same configs against the plain numpy model (``tests.test_models``), on
    random weights under our names, every position's logits, 3 layers (Gemma 2 and Qwen 2 alternate)."""
    import json

    from tests.test_models import numpy_llama
    from turnip.compile import build_with_resident, make_taskgraph
    from turnip.memgraph.interp import assemble
    from turnip.memgraph.plan import KIND_OFFLOAD
    from turnip.memgraph.verify import verify
    from turnip.models import load_config
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import logical_inputs, tile_inputs

    cfg = {**SMALL, "model_type": MODEL_TYPES[family], **FAMILIES[family][1], "num_hidden_layers": 3}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = load_config(tmp_path)
    budget = 45_000 // gpus
    tg = make_taskgraph(str(tmp_path), 2 * W, gpus, "fp32", {"t": W // 2, "kv": W, "v": 51}, budget_nbytes=budget,
                        head="all")  # fmt: skip
    mg = build_with_resident(tg, budget)
    assert verify(mg, tg) == [] and (mg.kind == KIND_OFFLOAD).any()
    rng = np.random.default_rng(4)
    base = 0.0 if s.norm_offset else 1.0
    w = {k: (base + 0.2 * rng.standard_normal(shape) if k.endswith("norm") else 0.3 * rng.standard_normal(shape))
         for k, (shape, _) in logical_inputs(tg).items()}  # fmt: skip
    with open_backend("cpu", mg, 3, chaos=0.3) as be:
        be.write_inputs(tile_inputs(tg, {k: v.astype(np.float32) for k, v in w.items()}))
        execute(mg, be, "nondet", 3, seed=2)
        got = assemble(tg, be.read_outputs(), "logits").astype(np.float64)
    want = numpy_llama(w, w["x0"], s, "all")
    assert np.abs(got - want).max() < 2e-4 * max(1.0, np.abs(want).max()), np.abs(got - want).max()
