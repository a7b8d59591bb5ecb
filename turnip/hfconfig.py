"""Hugging Face decoder families: a ``config.json`` read into ``LlamaConfig`` fields (``config_fields``), and
the checkpoint tensor behind each logical weight of a family (``hf_source``).

Every field of a config is implemented (read into the config), has no effect on a prefill's outputs
(``INERT``: token ids, dropout, initialisation, caching, the longest position), is unset (null or false),
or is refused: a ``ValueError`` of one line naming the field. No field is ignored. A field a config leaves
out takes transformers' default for its family (``DEFAULTS``), as transformers does.
"""

from __future__ import annotations

import math

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2")
SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
         "tie_word_embeddings", "hidden_act", "model_type")  # fmt: skip
_WINDOWED = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")
FIELDS = {  # the fields each family implements beyond SHAPE (mlp_bias: read to refuse it when true)
    "llama": ("attention_bias", "mlp_bias"),
    "mistral": ("sliding_window",),
    "qwen2": _WINDOWED,
    "qwen3": ("attention_bias", *_WINDOWED),
    "phi3": ("sliding_window", "partial_rotary_factor"),
    "gemma": ("attention_bias", "hidden_activation", "use_bidirectional_attention"),
    "gemma2": ("attention_bias", "hidden_activation", "use_bidirectional_attention", "sliding_window",
               "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"),
}  # fmt: skip
INERT = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "initializer_range", "use_cache", "cache_implementation", "max_position_embeddings",
    "original_max_position_embeddings", "attention_dropout", "resid_pdrop", "embd_pdrop", "pretraining_tp",
    "_name_or_path", "auto_map", "tokenizer_class", "output_attentions", "output_hidden_states", "return_dict",
    "id2label", "label2id",
})  # fmt: skip
DEFAULTS = {  # transformers' defaults that differ from LLaMA's, for fields a config leaves out
    "llama": {},
    "mistral": {"sliding_window": 4096},
    "qwen2": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "head_dim": 128},
    "phi3": {"rms_norm_eps": 1e-5},
    "gemma": {"head_dim": 256, "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"},
    "gemma2": {"head_dim": 256, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
               "sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
}  # fmt: skip
ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def config_fields(cfg: dict, name: str = "") -> dict:
    """``LlamaConfig`` keyword arguments (all but ``name``) from a Hugging Face ``config.json`` dict."""
    where = f"{name}: " if name else ""

    def refuse(msg: str):
        raise ValueError(where + msg)

    mt = cfg.get("model_type", "llama")
    if mt not in FAMILIES:
        refuse(f"model_type {mt!r} is not supported; turnip runs model_type {', '.join(FAMILIES)}")
    c = DEFAULTS[mt] | cfg
    known = set(SHAPE) | set(FIELDS[mt]) | INERT
    for k, v in c.items():
        if k not in known and v not in (None, False) and not (isinstance(v, dict | list) and not v):
            refuse(f"config field {k!r} ({str(v)[:60]}) is not implemented by turnip for model_type {mt}")
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in need if not isinstance(c.get(k), int) or c[k] < 1]
    if missing:
        refuse(f"config.json needs a positive integer {missing[0]!r}")
    if c.get("mlp_bias"):
        refuse("mlp_bias is true; turnip's FFN has no biases")
    if c.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention is true; turnip's attention is causal")
    d, L, H = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    Hk = c.get("num_key_value_heads") or H
    if H % Hk:
        refuse(f"{H} attention heads are not a multiple of {Hk} key-value heads")
    e = c.get("head_dim") or d // H
    if e % 2:
        refuse(f"head_dim {e} must be even (rotary embedding)")
    out = {"d_model": d, "n_layers": L, "n_heads": H, "d_ffn": c["intermediate_size"], "vocab": c["vocab_size"],
           "n_kv_heads": Hk, "head_dim": e, "eps": float(c.get("rms_norm_eps", 1e-6)), "arch": mt,
           "tie_embeddings": bool(c.get("tie_word_embeddings", False)), "act": _act(c, mt, refuse)}  # fmt: skip
    out |= _rope(c, refuse) | _window(c, mt, L, refuse)
    bias = bool(c.get("attention_bias"))
    out |= {"qkv_bias": bias or mt == "qwen2", "o_bias": bias, "qk_norm": mt == "qwen3"}
    if mt in ("gemma", "gemma2"):
        out |= {"norm_offset": 1.0, "embed_scale": math.sqrt(d)}
    if mt == "gemma2":
        s = c["query_pre_attn_scalar"]
        if not isinstance(s, int | float) or s <= 0:
            refuse(f"query_pre_attn_scalar {s!r} must be a positive number")
        out |= {"attn_scale": float(s) ** -0.5, "sandwich": True}
        for k, f in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "logit_softcap")):
            cap = c.get(k) or 0.0
            if not isinstance(cap, int | float) or cap < 0:
                refuse(f"{k} {cap!r} must be a positive number or null")
            out[f] = float(cap)
    return out


def _act(c: dict, mt: str, refuse) -> str:
    """The FFN's gated activation: ``silu`` or ``gelu_tanh``. Gemma reads ``hidden_act`` (its ``gelu`` means
    the tanh approximation, as transformers says), Gemma 2 ``hidden_activation``."""
    key = "hidden_activation" if mt == "gemma2" else "hidden_act"
    act = c.get(key, "silu")
    if mt == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"
    if act not in ACTS:
        refuse(f"{key} {act!r} is not supported (silu, gelu_pytorch_tanh)")
    other = "hidden_act" if mt == "gemma2" else "hidden_activation"
    if c.get(other) not in (None, act) and ACTS.get(c[other]) != ACTS[act]:
        refuse(f"{other} {c[other]!r} disagrees with {key} {act!r}")
    return ACTS[act]


def _rope(c: dict, refuse) -> dict:
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    part = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if part != 1.0:
        refuse(f"partial_rotary_factor {part} is not supported (rotary over the whole head only)")
    scaling: tuple = ()
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if any(k not in rope for k in keys):
            refuse(f"llama3 rope scaling needs {', '.join(keys)}")
        scaling = tuple(float(rope[k]) for k in keys)
    elif kind != "default":
        refuse(f"rope type {kind!r} is not supported (default and llama3 are)")
    return {"rope_theta": float(theta), "rope_scaling": scaling}


def _window(c: dict, mt: str, L: int, refuse) -> dict:
    """``window`` and ``window_layers``, as transformers decides which layers slide: every layer (Mistral,
    Phi-3), ``layer_types`` (Qwen 2/3 when ``use_sliding_window``: else layers from ``max_window_layers``
    on; Gemma 2: else every other layer, the first sliding)."""
    w = c.get("sliding_window") or 0
    types = c.get("layer_types")
    if mt in ("qwen2", "qwen3"):
        if not c.get("use_sliding_window"):
            if types and "sliding_attention" in types:
                refuse("layer_types names sliding layers but use_sliding_window is false")
            return {}
        if types is None:
            types = ["sliding_attention" if i >= c.get("max_window_layers", 28) else "full_attention"
                     for i in range(L)]  # fmt: skip
    elif mt == "gemma2" and types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    if types is not None:
        if not isinstance(types, list) or len(types) != L or set(types) - {"sliding_attention", "full_attention"}:
            refuse(f"layer_types must list full_attention or sliding_attention for each of the {L} layers")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if layers and not w:
            refuse("layer_types names sliding layers but sliding_window is not set")
        if not layers:
            return {}
    else:
        layers = tuple(range(L))
    if w == 0:
        return {}
    if not isinstance(w, int) or w < 1:
        refuse(f"sliding_window {w!r} must be a positive integer or null")
    return {"window": w, "window_layers": () if len(layers) == L else layers}


def hf_source(arch: str, ours: str, shapes: dict) -> tuple[str, tuple, tuple | None]:
    """(Hugging Face tensor name, its shape, rows (start, stop) of it or None: the whole tensor) behind the
    logical input ``ours`` of a model of family ``arch``, whose logical inputs have ``shapes`` (name ->
    shape). ``KeyError`` for a name that is no weight (``x0``). Phi-3's fused ``qkv_proj`` and
    ``gate_up_proj`` give row ranges (q, k, v and gate, up in that order); Gemma 2's ``ffn_norm`` is its
    ``pre_feedforward_layernorm`` and its ``post_attn_norm`` the ``post_attention_layernorm``."""
    top = {"tok_embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    shape = tuple(int(s) for s in shapes[ours])
    if ours in top:
        return top[ours], shape, None
    layer, _, what = ours.partition(".")
    if layer[:1] != "L" or not layer[1:].isdigit():
        raise KeyError(f"{ours!r} is not a weight with a Hugging Face name")
    p = f"model.layers.{int(layer[1:])}."
    if arch == "phi3" and what in ("wq", "wk", "wv", "w_gate", "w_up"):
        rows = {w: math.prod(shapes[f"{layer}.{w}"][:-1]) for w in ("wq", "wk", "wv", "w_gate", "w_up")}
        if what in ("w_gate", "w_up"):
            a = rows["w_gate"] if what == "w_up" else 0
            return p + "mlp.gate_up_proj.weight", (rows["w_gate"] + rows["w_up"], shape[-1]), (a, a + rows[what])
        a = {"wq": 0, "wk": rows["wq"], "wv": rows["wq"] + rows["wk"]}[what]
        n = rows["wq"] + rows["wk"] + rows["wv"]
        return p + "self_attn.qkv_proj.weight", (n, shape[-1]), (a, a + rows[what])
    ffn_norm = "pre_feedforward_layernorm" if arch == "gemma2" else "post_attention_layernorm"
    names = {
        "attn_norm": "input_layernorm.weight",
        "ffn_norm": ffn_norm + ".weight",
        "post_attn_norm": "post_attention_layernorm.weight",
        "post_ffn_norm": "post_feedforward_layernorm.weight",
        "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight",
        "w_gate": "mlp.gate_proj.weight",
        "w_up": "mlp.up_proj.weight",
        "w_down": "mlp.down_proj.weight",
    }
    names |= {f"w{x}": f"self_attn.{x}_proj.weight" for x in "qkvo"}
    names |= {f"b{x}": f"self_attn.{x}_proj.bias" for x in "qkvo"}  # fmt: skip
    if what not in names:
        raise KeyError(f"{ours!r} is not a weight with a Hugging Face name")
    if what in ("wq", "wk", "wv"):
        hf = (math.prod(shape[:-1]), shape[-1])
    elif what == "wo":
        hf = (shape[0], math.prod(shape[1:]))
    elif what[0] == "b":
        hf = (math.prod(shape),)
    else:
        hf = shape
    return p + names[what], hf, None
