"""Training: reverse-mode autodiff on the logical graph against finite differences, the LoRA step against
PyTorch + PEFT (when installed), training plans through the verifier and the CPU runtime under chaos, and
``turnip train``."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest

from tests.benchscripts import load_script
from tests.runtime.helpers import gpus
from turnip.autodiff import backward
from turnip.compile import build_with_resident
from turnip.graph import Graph, Tiling, TilingError, lower
from turnip.memgraph.interp import assemble, evaluate_taskgraph
from turnip.memgraph.verify import verify
from turnip.models import LLAMA
from turnip.runtime import execute, open_backend
from turnip.runtime.weights import random_inputs_for, tile_inputs
from turnip.train import AdapterState, LoraConfig, lora_step, next_token_targets, parse_targets, save_adapters

HAVE_PEFT = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft"))
needs_peft = pytest.mark.skipif(not HAVE_PEFT, reason="needs torch, transformers and peft")


# ---------------------------------------------------------------- autodiff vs finite differences


def _random_graph(rng, batch: int, seq: int, d: int = 8, heads: int = 2, group: int = 1):
    """A random chain of the LLaMA ops over x (tokens, d): projections, norms, SwiGLU, rotary attention,
    residuals, scales and casts; some weights trainable. Returns (graph, trainable inputs, output)."""
    g = Graph(dtype="fp32")
    n = batch * seq
    x = g.input("x", "td", (n, d))
    train: list[int] = []

    def w(name, dims, shape, trainable):
        t = g.input(name, dims, shape)
        if trainable:
            train.append(t)
        return t

    kinds = ["linear", "norm", "swiglu", "attn", "scale", "mul"]
    for i in range(5):
        kind = kinds[int(rng.integers(len(kinds)))] if i else "attn"
        tr = bool(rng.random() < 0.7)
        r = x  # the residual stream; blocks read it normed (pre-norm, as LLaMA: keeps the test well conditioned)
        if kind in ("linear", "swiglu", "attn"):
            x = g.rmsnorm(x, w(f"p{i}", "d", (d,), False))
        if kind == "linear":
            y = g.einsum("td,ed->te", x, w(f"W{i}", "ed", (d, d), tr), scale=0.5)
            x = g.map("add_n", r, g.einsum("te,de->td", y, w(f"V{i}", "de", (d, d), tr)))
        elif kind == "norm":
            x = g.rmsnorm(x, w(f"n{i}", "d", (d,), False))
        elif kind == "swiglu":
            a = g.einsum("td,fd->tf", x, w(f"G{i}", "fd", (2 * d, d), tr))
            b = g.einsum("td,fd->tf", x, w(f"U{i}", "fd", (2 * d, d), tr))
            x = g.map("add_n", r, g.einsum("tf,df->td", g.map("silu_mul", a, b), w(f"D{i}", "df", (d, 2 * d), tr)))
        elif kind == "attn":
            e, hk = d // heads, heads // group
            if group == 1:
                q = g.einsum("td,hed->the", x, w(f"Q{i}", "hed", (heads, e, d), tr))
            else:
                q = g.einsum("td,hred->thre", x, w(f"Q{i}", "hred", (hk, group, e, d), tr))
            k = g.einsum("td,hed->the", x, w(f"K{i}", "hed", (hk, e, d), tr))
            v = g.einsum("td,hed->the", x, w(f"Vv{i}", "hed", (hk, e, d), True))
            a = g.attention(g.rotary(q, theta=100.0, seq=seq), g.rotary(k, theta=100.0, seq=seq), v, seq=seq)
            o_sub = "the,dhe->td" if group == 1 else "thre,dhre->td"
            o_w = ("dhe", (d, heads, e)) if group == 1 else ("dhre", (d, hk, group, e))
            x = g.map("add_n", r, g.einsum(o_sub, a, w(f"O{i}", *o_w, tr)))
        elif kind == "scale":
            x = g.map("scale", x, alpha=0.7)
        else:
            y = g.map("mul", x, g.map("add_n", x, w(f"M{i}", "td", (n, d), tr)))
            x = g.rmsnorm(y, w(f"n{i}", "d", (d,), False))
    if not train:
        train.append(g.nodes[1].out.id)
    return g, train, x


@pytest.mark.parametrize("seed", range(8))
def test_autodiff_matches_finite_differences(seed):
    rng = np.random.default_rng(seed)
    batch, seq = (2, 4) if seed % 2 else (1, 6)
    g, train, y = _random_graph(rng, batch, seq, group=2 if seed % 3 == 0 else 1)
    dy = g.input("dy", g.t(y).dims, g.t(y).shape)
    grads = backward(g, {y: dy}, train)
    assert set(grads) == set(train)
    g.outputs = [y, *grads.values()]
    tiles = {"t": seq, "f": 8, "h": 1}  # token, head and FFN blocks: partial sums in the backward
    tg = lower(g, Tiling(tiles))
    vals = {g.t(n.out.id).name: rng.standard_normal(n.out.shape).astype(np.float32) * 0.5
            for n in g.nodes if n.op == "input"}  # fmt: skip
    for n in g.nodes:
        if n.op == "input" and n.out.name.startswith("n"):
            vals[n.out.name] = 1.0 + 0.1 * vals[n.out.name]

    def run(values):
        return evaluate_taskgraph(tg, tile_inputs(tg, values))

    out = run(vals)
    R = vals["dy"].astype(np.float64)
    for p in train:
        name = g.t(p).name
        grad = assemble(tg, out, g.t(grads[p]).name).astype(np.float64)
        u = rng.standard_normal(grad.shape)
        def central(h, name=name, u=u):
            lp, lm = (float((assemble(tg, run(vals | {name: (vals[name] + s * h * u).astype(np.float32)}),
                                      g.t(y).name) * R).sum()) for s in (1, -1))  # fmt: skip
            return (lp - lm) / (2 * h)

        fd = (4 * central(2e-3) - central(4e-3)) / 3  # Richardson: the h^2 term cancels
        an = float((grad * u).sum())
        assert abs(fd - an) <= 1e-2 * max(1.0, abs(fd)), f"{name}: finite difference {fd}, gradient {an}"


def test_no_gradient_for_frozen_inputs_and_clear_errors():
    g = Graph(dtype="fp32")
    x = g.input("x", "td", (4, 8))
    w = g.input("w", "d", (8,))
    y = g.rmsnorm(x, w)
    with pytest.raises(ValueError, match="norm weight w"):
        backward(g, {y: g.input("dy", "td", (4, 8))}, [w])
    g2 = Graph(dtype="fp32")
    a = g2.input("a", "td", (4, 8))
    z = g2.map("silu", a)
    with pytest.raises(ValueError, match="no gradient rule for op 'silu'"):
        backward(g2, {z: g2.input("dz", "td", (4, 8))}, [a])


# ---------------------------------------------------------------- the LoRA step


def _step_inputs(tg, cfg, seed=0, b_std=0.1, batch=2, seq=16):
    rng = np.random.default_rng(seed)
    weights = random_inputs_for(tg, seed=seed + 1)
    table = (0.5 * rng.standard_normal((cfg.vocab, cfg.d_model))).astype(np.float32)
    ids = rng.integers(0, cfg.vocab, size=(batch, seq))
    state = AdapterState.init(tg, seed=seed + 2, b_std=b_std)
    logical = dict(weights) | state.inputs() | {"targets": next_token_targets(ids)}
    dt = logical["x0"].dtype
    logical["x0"] = table[ids.reshape(-1)].astype(dt)
    if cfg.tie_embeddings:
        logical["tok_embed"] = table.astype(dt)
    return logical, weights | {"tok_embed": table}, ids, state


@pytest.mark.parametrize("n_gpus", [1, 2])
def test_training_plan_verifies_and_runs_on_the_cpu_backend_under_chaos(n_gpus):
    """A tight budget (offloads), random valid orders, one GPU or two (sequences split across them, adapter
    gradients summed across): every run's loss, gradients and new adapters equal the unconstrained
    evaluation (up to the order of partial sums)."""
    cfg = LLAMA["tiny-gqa"]
    tg = lora_step(cfg, seq=16, batch=2 * n_gpus, n_gpus=n_gpus, dtype="fp32", checkpoint="on")
    mg = build_with_resident(tg, 96 * 1024, None, "0")
    assert mg.stats["n_offload"] > 0
    assert not verify(mg, tg)
    assert (tg.op.count("transfer") > 0) == (n_gpus > 1)
    logical, *_ = _step_inputs(tg, cfg, batch=2 * n_gpus)
    values = tile_inputs(tg, logical)
    ref = evaluate_taskgraph(tg, values)
    firsts = None
    with open_backend("cpu", mg, 3, chaos=0.3, chaos_max_s=0.0003, poison=True) as be:
        be.write_inputs(values)
        for seed in range(8):
            execute(mg, be, "nondet", 3, seed=seed)
            out = be.read_outputs()
            for t, x in out.items():
                np.testing.assert_allclose(x, ref[t], rtol=1e-5, atol=1e-6, err_msg=f"run {seed}: {tg.name[t]}")
            firsts = firsts or out
            for t, x in out.items():  # run to run: within fp32 rounding of the partial sums' order
                np.testing.assert_allclose(x, firsts[t], rtol=1e-5, atol=1e-7)


def _steps_reference(tg, logical, batches, table):
    """Losses and final state of steps evaluated in numpy, the state handed over on the host."""
    from turnip.train import AdapterState as S

    state = S({k: logical[k] for k in logical if k.endswith(("lora_A", "lora_B"))},
              {k: logical[k + ".m"] for k in logical if k.endswith(("lora_A", "lora_B"))},
              {k: logical[k + ".v"] for k in logical if k.endswith(("lora_A", "lora_B"))})  # fmt: skip
    losses = []
    for ids in batches:
        lg = logical | state.inputs() | {"x0": table[ids.reshape(-1)], "targets": next_token_targets(ids)}
        vals = evaluate_taskgraph(tg, tile_inputs(tg, lg))
        losses.append(float(assemble(tg, vals, "loss").astype(np.float64).sum()) / tg.meta["train"]["predicted_tokens"])
        state.update({k: assemble(tg, vals, k) for k in tg.meta["output_blocks"]})
    return losses, state


@pytest.mark.parametrize("budget", [96 * 1024, 4 << 20])
def test_steps_hand_the_state_over_inside_the_backend(budget):
    """Three steps through ``Stepper`` (state carried by the backend: on the host under a tight budget,
    resident on the GPU arena under a roomy one) give the losses and adapters of three numpy steps."""
    from turnip.train import Stepper

    cfg = LLAMA["tiny"]
    tg = lora_step(cfg, seq=16, batch=2, dtype="fp32", lora=LoraConfig(lr=1e-2))
    mg = build_with_resident(tg, budget, None, "0")
    resident = int(mg.stats["resident_input_nbytes"])
    assert (resident > 0) == (budget > 1 << 20)
    logical, weights, _, state = _step_inputs(tg, cfg)
    rng = np.random.default_rng(9)
    batches = [rng.integers(0, cfg.vocab, size=(2, 16)) for _ in range(3)]
    table = weights["tok_embed"]
    want_losses, want = _steps_reference(tg, dict(logical), batches, table)
    with open_backend("cpu", mg, 3, chaos=0.2, chaos_max_s=0.0002, poison=True) as be:
        be.write_inputs(tile_inputs(tg, {k: x for k, x in logical.items() if k not in state.inputs()}))
        st = Stepper(tg, mg, be, state)
        got = [st.step(table[ids.reshape(-1)], next_token_targets(ids), streams=3, seed=i)[0]
               for i, ids in enumerate(batches)]
        final = st.fetch()
    np.testing.assert_allclose(got, want_losses, rtol=1e-5)
    assert final.step == 3
    for k in want.params:
        # Adam moves an element by about lr * sign(gradient): where a gradient is near 0, rounding (the order
        # of partial sums) can flip it, so a few elements may differ by up to 2 lr per step
        close = np.isclose(final.params[k], want.params[k], rtol=1e-4, atol=1e-6)
        assert close.mean() > 0.99 and np.abs(final.params[k] - want.params[k]).max() <= 6e-2, k
        np.testing.assert_allclose(final.v[k], want.v[k], rtol=1e-3, atol=1e-12, err_msg=k)


def test_checkpointing_keeps_only_each_layers_input_for_the_backward():
    """With recompute, the only forward tensors the backward reads are the layers' outputs (the next layer's
    input); without, it reads the layers' activations too."""
    from turnip.train import lora_graph

    def kept(checkpoint: bool) -> set[str]:
        g, _ = lora_graph(LLAMA["tiny"], 16, 2, "fp32", checkpoint=checkpoint)
        first = next(i for i, n in enumerate(g.nodes) if n.op == "xent_bwd")
        late = {x for i, n in enumerate(g.nodes) if i > first for x in n.inputs}
        return {g.nodes[x].out.name for x in late if x < first and g.nodes[x].op != "input"}

    assert kept(True) == {"L0.x2", "L1.x2"}
    assert {"L0.h", "L1.m", "L1.attn"} <= kept(False)
    on = lora_step(LLAMA["tiny"], seq=16, batch=2, dtype="fp32", checkpoint="on")
    assert on.meta["train"]["checkpoint"] and any(n.startswith("L1.m'") for n in on.name)


def test_training_arguments_are_checked():
    cfg = LLAMA["tiny"]
    with pytest.raises(ValueError, match="t must be a multiple of 16 .* up to 32"):
        lora_step(cfg, seq=16, batch=2, tiles={"t": 8})
    with pytest.raises(ValueError, match="t must be a multiple of 16"):
        lora_step(cfg, seq=16, batch=2, tiles={"t": 48})
    with pytest.raises(ValueError, match="unknown LoRA target 'x'"):
        parse_targets("q,x")
    assert parse_targets("ffn,q") == ("q", "gate", "up", "down")
    with pytest.raises(ValueError, match="at least 2 tokens"):
        lora_step(cfg, seq=1)
    with pytest.raises(ValueError, match="rank must be positive"):
        lora_step(cfg, seq=16, lora=LoraConfig(rank=0))
    with pytest.raises(TilingError, match="token tile dividing"):
        g = Graph()
        q = g.input("q", "the", (8, 2, 4))
        g.attention(q, q, q, seq=4)
        lower(g, Tiling({"t": 3}))


def _peft():
    return load_script("lora_peft")


@needs_peft
@pytest.mark.parametrize("model,checkpoint", [("tiny", "off"), ("tiny", "on"), ("tiny-gqa", "on")])
def test_lora_step_matches_pytorch_peft(model, checkpoint):
    """Loss, every adapter's gradient and Adam's new adapters against PyTorch + PEFT, fp32."""
    lp = _peft()
    cfg = LLAMA[model]
    lora = LoraConfig(rank=4, alpha=8.0, targets=parse_targets("q,k,v,o,ffn"), lr=1e-3)
    tg = lora_step(cfg, seq=16, batch=2, dtype="fp32", checkpoint=checkpoint, lora=lora)
    logical, weights, ids, state = _step_inputs(tg, cfg)
    vals = evaluate_taskgraph(tg, tile_inputs(tg, logical))
    pm = lp.peft_model(cfg, weights, lora, "fp32", "cpu")
    lp.set_adapters(pm, state)
    ref = lp.peft_step(pm, ids, state, lora, lp.adam(pm, lora))
    loss = float(assemble(tg, vals, "loss").sum()) / tg.meta["train"]["predicted_tokens"]
    assert abs(loss - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert len(ref["grads"]) == 2 * 7 * cfg.n_layers
    for k, gr in ref["grads"].items():
        assert lp.rel(assemble(tg, vals, k + ".grad"), gr) <= 1e-4, k
        step = assemble(tg, vals, k + ".new") - state.params[k]
        np.testing.assert_allclose(step, ref["new"][k] - state.params[k], atol=lora.lr * 1e-2, err_msg=k)


@needs_peft
def test_twenty_steps_follow_pytorch_loss_curve(tmp_path):
    lp = _peft()
    import torch

    cfg = LLAMA["tiny"]
    lora = LoraConfig(rank=4, alpha=8.0, lr=1e-2)
    tg = lora_step(cfg, seq=16, batch=2, dtype="fp32", lora=lora)
    logical, weights, ids, state = _step_inputs(tg, cfg, b_std=0.0)
    pm = lp.peft_model(cfg, weights, lora, "fp32", "cpu")
    lp.set_adapters(pm, state)
    opt = lp.adam(pm, lora)
    ours, theirs = [], []
    table = weights["tok_embed"]
    for _ in range(20):  # one batch over and over: the loss must fall
        logical |= state.inputs() | {"x0": table[ids.reshape(-1)], "targets": next_token_targets(ids)}
        vals = evaluate_taskgraph(tg, tile_inputs(tg, logical))
        ours.append(float(assemble(tg, vals, "loss").sum()) / tg.meta["train"]["predicted_tokens"])
        state.update({k: assemble(tg, vals, k) for k in tg.meta["output_blocks"]})
        theirs.append(lp.peft_step(pm, ids, state, lora, opt)["loss"])
    assert ours[-1] < ours[0] - 0.05, "the loss should fall"
    np.testing.assert_allclose(ours, theirs, rtol=2e-3)
    torch.manual_seed(0)


def test_adapters_save_in_peft_layout(tmp_path):
    cfg = LLAMA["tiny-gqa"]
    tg = lora_step(cfg, seq=8, batch=1, dtype="fp32")
    state = AdapterState.init(tg, seed=3, b_std=0.1)
    out = save_adapters(tmp_path / "ad", state, tg, base_model="x")
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["r"] == 16 and conf["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "gate_proj",
                                                                  "up_proj", "down_proj"])  # fmt: skip
    from turnip.checkpoint import Checkpoint

    ck = Checkpoint(out / "adapter_model.safetensors")
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    assert tuple(ck.header(name).shape) == (cfg.n_heads * cfg.dh, 16)
    np.testing.assert_array_equal(ck.read(name), state.params["L1.q.lora_B"].reshape(-1, 16))
    assert not (tmp_path / "ad.partial").exists()


@needs_peft
def test_peft_loads_saved_adapters(tmp_path):
    lp = _peft()
    from peft import PeftModel

    cfg = LLAMA["tiny"]
    lora = LoraConfig(rank=4, alpha=8.0)
    tg = lora_step(cfg, seq=8, batch=1, dtype="fp32", lora=lora)
    _, weights, _, state = _step_inputs(tg, cfg, batch=1, seq=8)
    save_adapters(tmp_path / "ad", state, tg)
    base = lp.peft_model(cfg, weights, lora, "fp32", "cpu").get_base_model()
    pm = PeftModel.from_pretrained(base, str(tmp_path / "ad"))
    mods = lp.lora_modules(pm)
    for k, x in state.params.items():
        np.testing.assert_array_equal(mods[k].weight.detach().numpy().reshape(x.shape), x)


# ---------------------------------------------------------------- the CLI


def test_turnip_train_cli(tmp_path, capsys):
    from turnip.cli import main

    ids = np.random.default_rng(0).integers(0, 64, size=500)
    np.save(tmp_path / "ids.npy", ids)
    rc = main(["train", "--model", "llama-tiny", "--seq", "16", "--batch", "2", "--steps", "3", "--budget",
               "128KiB", "--lr", "1e-2", "--data", str(tmp_path / "ids.npy"), "--csv", str(tmp_path / "s.csv"),
               "--out", str(tmp_path / "ad"), "--dtype", "fp32"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "step    3/3  loss" in out and "median step" in out
    import pandas as pd

    rows = pd.read_csv(tmp_path / "s.csv")
    assert list(rows.step) == [1, 2, 3] and np.isfinite(rows.loss).all()
    assert abs(rows.loss[0] - math.log(64)) < 0.5  # random weights: about uniform over the vocabulary
    assert (tmp_path / "ad" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("args,msg", [
    (["--data", "missing.npy"], "--data"),
    (["--targets", "q,zz"], "unknown LoRA target 'zz'"),
    (["--tile", "t=4"], "t must be a multiple of 16"),
    (["--seq", "1"], "--seq"),
])  # fmt: skip
def test_turnip_train_errors_are_one_line(args, msg, capsys, tmp_path, monkeypatch):
    from turnip.cli import main

    monkeypatch.chdir(tmp_path)
    try:
        rc = main(["train", "--model", "llama-tiny", "--seq", "16", "--steps", "1", *args])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert msg in err and err.strip().splitlines()[-1].startswith("error:")


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,budget,tol,t", [("fp32", 1 << 24, 1e-4, 16), ("fp32", 96 * 1024, 1e-4, 16),
                                                ("fp16", 1 << 24, 2e-2, 16), ("fp32", 1 << 24, 1e-4, 32),
                                                ("fp16", 160 * 1024, 2e-2, 32)])  # fmt: skip
def test_training_step_on_the_cuda_backend(dtype, budget, tol, t):
    """Loss, gradients and new adapters of the CUDA runtime against the numpy evaluation of the same plan
    (t 32: token tiles of two sequences)."""
    cfg = LLAMA["tiny-gqa"]
    tg = lora_step(cfg, seq=16, batch=2, dtype=dtype, checkpoint="on", tiles={"t": t})
    _check_on_cuda(tg, build_with_resident(tg, budget, None, "0"), cfg, 2, tol)


def _check_on_cuda(tg, mg, cfg, batch: int, tol: float) -> None:
    """One step of ``mg`` on the CUDA backend, nondet then det, against the numpy evaluation of ``tg``."""
    from tests.runtime.helpers import rel_err

    logical, *_ = _step_inputs(tg, cfg, batch=batch)
    values = tile_inputs(tg, logical)
    ref = evaluate_taskgraph(tg, values)
    with open_backend("cuda", mg, 5) as be:
        be.write_inputs(values)
        for policy in ("nondet", "det"):
            execute(mg, be, policy, 5, seed=1)
            out = be.read_outputs()
            worst = max((rel_err(out[t], ref[t]), tg.name[t]) for t in out if np.abs(ref[t]).max() > 0)
            assert worst[0] <= tol, worst


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("split", ["data", "layers"])
def test_two_gpu_training_step_on_the_cuda_backend(split):
    """A step split over two GPUs (sequences with replicated weights, or layers), under a budget that
    offloads, against the numpy evaluation of the same plan."""
    cfg = LLAMA["tiny-gqa"]
    tg = lora_step(cfg, seq=16, batch=4, n_gpus=2, dtype="fp32", checkpoint="on", split=split)
    mg = build_with_resident(tg, 160 * 1024, None, "0")
    assert verify(mg, tg) == []
    _check_on_cuda(tg, mg, cfg, 4, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("budget", [96 * 1024, 4 << 20])
def test_steps_on_the_cuda_backend_hand_the_state_over(budget):
    from turnip.train import Stepper

    cfg = LLAMA["tiny-gqa"]
    tg = lora_step(cfg, seq=16, batch=2, dtype="fp32", lora=LoraConfig(lr=1e-2))
    mg = build_with_resident(tg, budget, None, "0")
    logical, weights, _, state = _step_inputs(tg, cfg)
    rng = np.random.default_rng(9)
    batches = [rng.integers(0, cfg.vocab, size=(2, 16)) for _ in range(3)]
    table = weights["tok_embed"]
    want_losses, want = _steps_reference(tg, dict(logical), batches, table)
    with open_backend("cuda", mg, 5) as be:
        be.write_inputs(tile_inputs(tg, {k: x for k, x in logical.items() if k not in state.inputs()}))
        st = Stepper(tg, mg, be, state)
        got = [st.step(table[ids.reshape(-1)], next_token_targets(ids), seed=i)[0] for i, ids in enumerate(batches)]
        final = st.fetch()
    np.testing.assert_allclose(got, want_losses, rtol=1e-4)
    for k in want.params:
        close = np.isclose(final.params[k], want.params[k], rtol=1e-4, atol=1e-6)
        assert close.mean() > 0.99, k


@pytest.mark.parametrize("args,msg", [
    (["--train", "lora", "--batch", "2"], "turnip train --data"),
    (["--batch", "2"], "a prompt is one sequence"),
])  # fmt: skip
def test_run_refuses_prompts_for_training_and_batches(args, msg, capsys, tmp_path):
    from turnip.cli import main

    np.save(tmp_path / "ids.npy", np.arange(8))
    assert main(["run", "--model", "llama-tiny", "--seq", "8", "--prompt-ids", str(tmp_path / "ids.npy"), *args]) == 2
    assert msg in capsys.readouterr().err
