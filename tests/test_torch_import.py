"""The torch.export importer (``turnip.torchimport``): small random models exported by PyTorch (an MLP stack,
GPT-2, a ViT, LLaMA from transformers), compiled under budgets that tile and offload, every memgraph verified,
run on the CPU backend and compared with the module's own outputs; ops without a lowering refused in one
error that lists them all."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cpu_runtime


def rel(got, want) -> float:
    want = np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(np.asarray(got, dtype=np.float64) - want) / np.linalg.norm(want))


def check(module, inputs, budget, gpus=1, dtype="fp32", tol=2e-5, offloads=True):
    """Compile, verify, run on the CPU backend and compare every output with the module's."""
    from turnip.torchimport.api import from_torch

    imp = from_torch(module, inputs, budget=budget, gpus=gpus, dtype=dtype)
    assert imp.verify() == []
    assert imp.stats["tiles"], "the budget tiles some dimension"
    if offloads:
        assert imp.mg.stats["n_offload"] + imp.mg.stats["n_reload"] > 0, "the budget makes the plan offload"
    got = imp.run(*inputs)
    with torch.no_grad():
        want = module(*inputs)
    want = [want] if isinstance(want, torch.Tensor) else [w for w in (want.values() if hasattr(want, "values")
                                                                          else want)]  # fmt: skip
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == tuple(w.shape)
        assert rel(g, w.float().numpy()) < tol
    return imp


class Block(torch.nn.Module):
    """A residual MLP block with a square projection (its input and output dims are one dimension class)."""

    def __init__(self, d, f):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, f), torch.nn.Linear(f, d)
        self.mix = torch.nn.Linear(d, d, bias=False)

    def forward(self, x):
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return x + h + self.mix(torch.relu(x)) * 0.5


@pytest.mark.parametrize("gpus,dtype", [(1, "fp32"), (2, "fp32"), (1, "fp16")])
def test_mlp_stack_matches_torch(gpus, dtype):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(24, 64), Block(64, 160), Block(64, 160), torch.nn.Linear(64, 10))
    x = torch.randn(40, 24)
    imp = check(m, (x,), budget=(60_000 if dtype == "fp32" else 30_000) // gpus, gpus=gpus, dtype=dtype,
                tol=2e-5 if dtype == "fp32" else 1e-2)
    assert set(imp.tg.gpu.tolist()) == set(range(gpus))


def _hf(name, **cfg):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, name + "Config")(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    cls = {"GPT2": "GPT2LMHeadModel", "ViT": "ViTForImageClassification", "Llama": "LlamaForCausalLM"}[name]
    return getattr(transformers, cls)(config).eval()


def test_gpt2_matches_transformers():
    m = _hf("GPT2", n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=64, use_cache=False,
            bos_token_id=0, eos_token_id=0)  # fmt: skip
    imp = check(m, (torch.randint(0, 101, (1, 24)),), budget=60_000)
    sdpa = [p for op, p in zip(imp.tg.op, imp.tg.params, strict=True) if op == "sdpa"]
    assert sdpa and all(p["causal"] for p in sdpa), "the constant causal mask became causal attention"


def test_vit_matches_transformers_on_two_gpus():
    m = _hf("ViT", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
            patch_size=8, num_labels=10)  # fmt: skip
    imp = check(m, (torch.randn(2, 3, 32, 32),), budget=80_000, gpus=2, offloads=False)  # two images
    sdpa = [p for op, p in zip(imp.tg.op, imp.tg.params, strict=True) if op == "sdpa"]
    assert sdpa and not any(p["causal"] for p in sdpa), "a ViT attends both ways"


@pytest.mark.parametrize("dtype,tol,batch", [("fp32", 2e-5, 1), ("fp16", 1e-2, 1), ("fp32", 2e-5, 2)])
def test_llama_matches_transformers(dtype, tol, batch):
    m = _hf("Llama", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    ids = torch.randint(0, 101, (batch, 24))  # a batch: one attention per sequence
    imp = check(m, (ids,), budget=36_000 if dtype == "fp32" else 18_000, dtype=dtype, tol=tol)
    sdpa = [p for op, p in zip(imp.tg.op, imp.tg.params, strict=True) if op == "sdpa"]
    assert sdpa and all(p["causal"] for p in sdpa), "the constant causal mask became causal attention"


def test_unsupported_ops_are_refused_in_one_error_listing_all():
    from turnip.torchimport.api import from_torch
    from turnip.torchimport.trace import UnsupportedOps

    class Odd(torch.nn.Module):
        def forward(self, x):
            y = torch.cumsum(x, 0) + torch.sort(x, dim=1).values  # the ops after one are checked too
            return torch.cumsum(y, 1) + torch.nn.functional.conv1d(x[None], torch.ones(4, 4, 1))[0]

    with pytest.raises(UnsupportedOps) as e:
        from_torch(Odd(), (torch.randn(4, 4),), budget="1MiB")
    assert e.value.ops["aten.cumsum"] == 2 and e.value.ops["aten.sort"] == 1
    assert any(k.startswith("aten.conv1d") for k in e.value.ops)
    assert "4 op(s) have no lowering" in str(e.value)


def test_turnip_compile_torch_writes_a_plan_that_runs(tmp_path, capsys):
    from turnip.cli import main

    f = tmp_path / "model.py"
    f.write_text("import torch\n\ndef factory():\n    torch.manual_seed(0)\n"
                 "    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))\n"
                 "    return m, (torch.randn(12, 16),)\n\n"
                 "def boom():\n    raise RuntimeError('no weights')\n")  # fmt: skip
    plan = tmp_path / "p.tplan"
    assert main(["compile", "--torch", f"{f}:factory", "--budget", "8KiB", "--verify", "-o", str(plan)]) == 0
    assert "verify    ok" in capsys.readouterr().out
    assert main(["verify", str(plan)]) == 0
    assert main(["run", str(plan), "--backend", "cpu"]) == 0
    assert main(["compile", "--torch", f"{f}:nope"]) == 2
    assert "has no function 'nope'" in capsys.readouterr().err
    assert main(["compile", "--torch", f"{f}:boom"]) == 2
    assert "boom() failed: RuntimeError: no weights" in capsys.readouterr().err


def test_imported_llama_matches_the_builder_path_and_uses_its_fused_ops(tmp_path):
    """The same transformers LLaMA through the importer and through the LLaMA builder (its saved directory):
    the same logits (fp16), and the imported graph is made of the builder's ops only (GPU kernels exist), its
    contractions each one strided GEMM."""
    from cuda_kernels import gemm as gm
    from cuda_kernels.kernels import OPS as GPU_OPS
    from turnip.checkpoint import Checkpoint
    from turnip.compile import build_with_resident, make_taskgraph
    from turnip.memgraph.interp import assemble
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import write_streaming
    from turnip.torchimport.api import from_torch

    m = _hf("Llama", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    m.save_pretrained(tmp_path, safe_serialization=True)
    ids = torch.randint(0, 101, (1, 32))
    imp = from_torch(m, (ids,), budget=30_000, dtype="fp16")
    assert imp.stats["fused"]["rmsnorm"] == 5 and imp.stats["fused"]["rotary"] == 4
    assert set(imp.tg.op) - {"input", "transfer"} <= set(GPU_OPS)
    for v in np.flatnonzero(np.asarray(imp.tg.op) == "einsum"):  # each one strided cuBLAS GEMM, as the builder's
        a, b = (tuple(imp.tg.shape[u]) for u in imp.tg.args(v)[:2])
        assert gm.cublas_layout(gm.plan_einsum(imp.tg.params[v]["subscripts"], a, b, tuple(imp.tg.shape[v])))
    got = imp.run(ids)[0][0]
    tg = make_taskgraph(str(tmp_path), 32, 1, "fp16", budget_nbytes=30_000, head="all")
    mg = build_with_resident(tg, 30_000)
    with open_backend("cpu", mg, 3) as be:
        write_streaming(be, tg, Checkpoint(tmp_path).iter_inputs(tg, ids=ids[0].numpy()))
        execute(mg, be, "nondet", 3, seed=0)
        want = assemble(tg, be.read_outputs(), "logits")
    assert rel(got, want) < 1e-2
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("resident", ["0", "auto"])
def test_a_session_runs_new_inputs_with_the_constants_written_once(resident):
    """``Imported.session``: the plan loaded and its constants written once; each call writes only its inputs
    (also where the plan keeps the input itself resident on the GPU) and gives torch's outputs for them."""
    from turnip.torchimport.api import from_torch

    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(24, 64), Block(64, 160), torch.nn.Linear(64, 10)).eval()
    xs = [torch.randn(40, 24) for _ in range(3)]
    imp = from_torch(m, (xs[0],), budget=1 << 20, resident=resident)
    assert imp.verify() == []
    call = set(imp.call_blocks(xs[0]))
    on_gpu = imp.mg.preloaded() & np.isin(imp.mg.tensor, list(call))
    assert on_gpu.any() == (resident == "auto")  # auto: the input itself stays on the GPU between runs
    with imp.session("cpu") as s:
        wrote = []
        real = s.be.write_inputs
        s.be.write_inputs = lambda values, **kw: (wrote.append(set(values)), real(values, **kw))[1]
        for i, x in enumerate(xs):
            got = s(x, seed=i)[0]
            with torch.no_grad():
                want = m(x).numpy()
            assert rel(got, want) < 2e-5
        assert s.stats["calls"] == 3 and s.stats["last_makespan_ns"] > 0
        assert wrote == [call] * 3 and not call & set(imp.constant_blocks())
    with pytest.raises(RuntimeError, match="closed"):
        s(xs[0])
    with pytest.raises(TypeError, match="takes 1 input"), imp.session("cpu") as s2:
        s2(xs[0], xs[1])
    with pytest.raises(ValueError, match="elements"):
        imp.call_blocks(torch.randn(41, 24))


@pytest.mark.gpu
def test_a_session_on_the_gpu_gives_torchs_outputs_call_after_call():
    """On a GPU: an imported MLP stack in a CUDA session (weights and the input resident) gives torch's
    outputs for each of three inputs."""
    from tests.runtime.helpers import gpus
    from turnip.torchimport.api import from_torch

    if gpus() < 1:
        pytest.skip("needs a CUDA device")
    torch.manual_seed(2)
    m = torch.nn.Sequential(torch.nn.Linear(24, 64), Block(64, 160), torch.nn.Linear(64, 10)).eval()
    xs = [torch.randn(40, 24) for _ in range(3)]
    imp = from_torch(m, (xs[0],), budget=1 << 20)
    assert imp.verify() == [] and imp.mg.preloaded().any()
    with imp.session("cuda") as s:
        for x in xs:
            with torch.no_grad():
                assert rel(s(x)[0], m(x).numpy()) < 2e-5
