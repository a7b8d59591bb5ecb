"""Generation (``turnip.generation``) on the CPU backend: greedy tokens equal to Hugging Face ``generate`` on a
random tiny LLaMA built by transformers (batch 1 and 4 with prompts of different lengths, 1 and 2 GPUs, a
cache that spills to the host), every plan through the verifier; chaos runs, the plan cache, sampling,
stopping and bad input."""

import numpy as np
import pytest

from turnip.generation import GenerateError, Model, Sampling, carry_rows_on, generate, load_model, sample
from turnip.plancache import PlanCache

pytestmark = pytest.mark.cpu_runtime

VOCAB = 97
LENS = (11, 5, 8, 1)  # a prompt of one token has nothing to prefill
BLOCK = 16  # 64 new tokens cross four cache blocks: four decode plans
NEW = 64


def random_llama(torch, transformers, cfg, seed: int, path):
    """A ``LlamaForCausalLM`` of ``cfg`` (eager attention) with seeded weights large enough that greedy tokens
    vary (norms near 1), saved to ``path``."""
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.2) + (1.0 if "norm" in n else 0.0))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(model directory, transformers model, prompts, each prompt's 64 greedy tokens from HF generate)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                                   max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    d = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model = random_llama(torch, transformers, cfg, 0, d)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, size=n) for n in LENS]
    want = []
    for p in prompts:  # one at a time, unpadded: the reference for the padded batch too
        with torch.no_grad():
            out = model.generate(torch.tensor(p)[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)  # fmt: skip
        want.append(out[0, len(p) :].tolist())
    return d, model, prompts, want


@pytest.mark.parametrize("batch,gpus,budget", [(1, 1, 1 << 20), (4, 1, 40_000), (1, 2, 20_000), (4, 2, 24_000)])
def test_greedy_tokens_equal_transformers(hf, tmp_path, batch, gpus, budget):
    """64 greedy tokens per prompt in fp32 equal HF's; under the small budgets the cache is larger than the
    GPUs' memory: its blocks live on the host and cross the link when a step reads them. Every plan passes
    the verifier."""
    from turnip.decode import state_inputs
    from turnip.kvcache import HostCache
    from turnip.memgraph.plan import KIND_INPUT

    d, _, prompts, want = hf
    m = load_model(str(d), "fp32")
    plans = PlanCache(m.cfg, budget, gpus, "fp32", BLOCK, verify=True)
    res = generate(m, prompts[:batch], NEW, budget, gpus, plans=plans, block=BLOCK, eos=(), seed=3)
    assert res.ids == want[:batch]
    decode = sorted(k for k in plans.plans if k[0] == "decode")
    assert [k[2] for k in decode] == list(range(1, len(decode) + 1)) and len(decode) >= 4
    if budget < 1 << 20:
        tg, mg = plans.plans[decode[-1]]
        assert HostCache(m.cfg, batch, BLOCK, "fp32").nbytes(decode[-1][2]) > budget * gpus
        cache = np.isin(mg.tensor, state_inputs(tg)) & (mg.kind == KIND_INPUT)
        assert (cache & ~mg.preloaded()).any()


@pytest.fixture(scope="module")
def hf_scores(hf):
    """Per prompt, HF's fp32 greedy logits (32 steps, vocab) along its own tokens."""
    import torch

    _, model, prompts, _ = hf
    out = []
    for p in prompts:
        with torch.no_grad():
            r = model.generate(torch.tensor(p)[None], max_new_tokens=32, do_sample=False, pad_token_id=0,
                               eos_token_id=None, output_scores=True, return_dict_in_generate=True)  # fmt: skip
        out.append(torch.stack(r.scores)[:, 0].numpy())
    return out


NEAR_TIE = {"fp16": 0.01, "bf16": 0.15}  # of the largest |logit|: a margin half precision may not resolve


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_follows_the_greedy_tokens_up_to_a_near_tie(hf, hf_scores, dtype):
    """fp16 and bf16 caches (the mask's -BIG exact in both) give HF's fp32 tokens until a step where HF's own
    logits of its token and ours lie within ``NEAR_TIE`` of each other (rounding there picks either; seen on
    random models at 0.3% in fp16 and 10% in bf16 of the largest logit): every prompt, 32 tokens. In fp16
    the first 16 tokens of the first two prompts are HF's."""
    d, _, prompts, want = hf
    got = generate(load_model(str(d), dtype), prompts, 32, 1 << 20, block=8, eos=()).ids
    for b, (g, w, s) in enumerate(zip(got, want, hf_scores, strict=True)):
        i = next((i for i, (x, y) in enumerate(zip(g, w[:32], strict=False)) if x != y), None)
        if i is not None:
            margin = float(s[i, w[i]] - s[i, g[i]])
            assert margin <= NEAR_TIE[dtype] * float(np.abs(s[i]).max()), (b, i, margin)
    if dtype == "fp16":
        assert [g[:16] for g in got[:2]] == [w[:16] for w in want[:2]]


@pytest.mark.parametrize("gpus,budget", [(1, 40_000), (2, 24_000)])
def test_the_prefill_gives_the_first_token(hf, monkeypatch, gpus, budget):
    """``TURNIP_PREFILL_TOKEN=1``: the prefill runs every prompt token and its logits give the first new token
    (prompts of four lengths in one batch, the cache spilling to the host): HF's 64 fp32 greedy tokens; every
    plan verified, the first decode plan's cache starting at the longest prompt's length."""
    monkeypatch.setenv("TURNIP_PREFILL_TOKEN", "1")
    d, _, prompts, want = hf
    m = load_model(str(d), "fp32")
    plans = PlanCache(m.cfg, budget, gpus, "fp32", BLOCK, verify=True)
    res = generate(m, prompts, NEW, budget, gpus, plans=plans, block=BLOCK, eos=(), seed=3)
    assert res.ids == want
    assert [k[0] for k in plans.plans].count("prefill+logits") == 1 and "prefill" not in [k[0] for k in plans.plans]
    first = min(k[2] for k in plans.plans if k[0] == "decode")
    assert first == max(LENS) // BLOCK + 1 and res.stats["steps"] == NEW


@pytest.mark.parametrize("gpus,budget,first", [(1, 40_000, "0"), (2, 24_000, "1"), (1, 1 << 20, "1")])
def test_steps_with_new_rows_as_outputs_give_the_greedy_tokens(hf, monkeypatch, gpus, budget, first):
    """``TURNIP_DECODE_ROWS=1``: every cache block read-only in a step, the new rows its outputs, copied into the
    host cache and their block between steps: HF's 64 fp32 greedy tokens for four prompts of different lengths
    (the cache spilling to the host under the small budgets, kept on the GPU under 1 MiB), with and without
    the prefill's first token; every plan verified, no decode plan makes a block."""
    monkeypatch.setenv("TURNIP_DECODE_ROWS", "1")
    monkeypatch.setenv("TURNIP_PREFILL_TOKEN", first)
    d, _, prompts, want = hf
    m = load_model(str(d), "fp32")
    plans = PlanCache(m.cfg, budget, gpus, "fp32", BLOCK, verify=True)
    res = generate(m, prompts, NEW, budget, gpus, plans=plans, block=BLOCK, eos=(), seed=3)
    assert res.ids == want
    for k, (tg, _) in plans.plans.items():
        if k[0] == "decode":
            assert tg.meta["decode"]["rows"]
            outs = [c["output"] for c in tg.meta["kv"] if c["output"] >= 0]
            assert outs and all(tg.shape[o][0] == 1 for o in outs)


def test_new_rows_as_outputs_survive_chaos_and_poison(monkeypatch):
    """With ``TURNIP_DECODE_ROWS=1`` random delays change no token, nor arenas filled with NaN before every
    step (every byte a step reads was written in it or carried into it)."""
    m = load_model("llama-tiny", "fp32", seed=5)
    prompts = [[3, 9, 27, 17, 2], [40, 41]]
    monkeypatch.setenv("TURNIP_DECODE_ROWS", "0")
    base = generate(m, prompts, 8, 48_000, block=4, eos=())
    monkeypatch.setenv("TURNIP_DECODE_ROWS", "1")
    for s in (1, 2):
        assert generate(m, prompts, 8, 48_000, block=4, eos=(), chaos=0.5, seed=s).ids == base.ids
    assert generate(m, prompts, 8, 48_000, block=4, eos=(), options={"poison": True}).ids == base.ids


def test_a_prompt_filling_its_blocks_needs_no_plan_for_one_step(monkeypatch):
    """A prompt as long as two blocks: decoding from its last token (the prefill without logits) runs that token
    in the two-block plan and then loads the three-block one; with ``TURNIP_PREFILL_TOKEN=1`` the prefill gives
    the first token and one plan serves every step. Same tokens, chaos on both."""
    m = load_model("llama-tiny", "fp32", seed=2)
    prompt = [[(7 * i) % 90 + 3 for i in range(8)]]
    got, decode = {}, {}
    for on in ("0", "1"):
        monkeypatch.setenv("TURNIP_PREFILL_TOKEN", on)
        plans = PlanCache(m.cfg, 48_000, 1, "fp32", 4, verify=True)
        r = generate(m, prompt, 4, 48_000, block=4, plans=plans, eos=(), chaos=0.3, seed=1)
        got[on], decode[on] = r.ids, sorted(k[2] for k in plans.plans if k[0] == "decode")
    assert got["0"] == got["1"]
    assert decode == {"0": [2, 3], "1": [3]}


def test_last_token_rows_pick_each_prompts_last_position():
    from turnip.decode import last_token_rows

    sel = last_token_rows([3, 1], 4, "fp32")
    assert sel.shape == (2, 8) and sel.sum() == 2 and sel[0, 2] == 1 and sel[1, 4] == 1
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        last_token_rows([5], 4, "fp32")


def test_chaos_runs_give_identical_tokens():
    """Random delays per vertex change the order every step runs in, never the tokens; nor do arenas filled
    with NaN before every step."""
    m = load_model("llama-tiny", "fp32", seed=5)
    prompts = [[3, 9, 27, 17, 2], [40, 41]]
    base = generate(m, prompts, 8, 48_000, block=4, eos=())
    for s in (1, 2):
        again = generate(m, prompts, 8, 48_000, block=4, eos=(), chaos=0.5, seed=s)
        assert again.ids == base.ids
    poisoned = generate(m, prompts, 8, 48_000, block=4, eos=(), options={"poison": True})
    assert poisoned.ids == base.ids  # every byte a step reads was written in that step, or carried into it


def test_plans_are_kept_on_disk_and_prefetched(tmp_path):
    """A second generation loads every plan from the directory; the next bucket's plan is built in the
    background before the generation needs it."""
    m = load_model("llama-tiny", "fp32")
    first = generate(m, [[1, 2, 3]], 6, 1 << 20, block=4, plan_dir=tmp_path, eos=())
    assert first.stats["plans_built"] and not first.stats["plans_loaded"]
    assert len(list(tmp_path.glob("*.plan"))) == len(first.stats["plans_built"])
    again = generate(m, [[1, 2, 3]], 6, 1 << 20, block=4, plan_dir=tmp_path, eos=())
    assert again.ids == first.ids and not again.stats["plans_built"]
    assert sorted(again.stats["plans_loaded"]) == sorted(first.stats["plans_built"])
    other = PlanCache(m.cfg, 1 << 19, 1, "fp32", 4, tmp_path)  # another budget: another file
    assert other.path(("decode", 1, 2)) != PlanCache(m.cfg, 1 << 20, 1, "fp32", 4, tmp_path).path(("decode", 1, 2))
    plans = PlanCache(m.cfg, 1 << 20, 1, "fp32", 4)
    plans.prefetch("decode", 2, 3)
    plans.pending[("decode", 2, 3)].join()
    assert ("decode", 2, 3) in plans.plans and plans.get("decode", 2, 3) is plans.plans[("decode", 2, 3)]


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    m = load_model("llama-tiny", "fp32")
    p = [[5, 6, 7]]
    greedy = generate(m, p, 6, 1 << 20, block=8, eos=()).ids
    assert generate(m, p, 6, 1 << 20, block=8, eos=(), sampling=Sampling(1.0, top_k=1)).ids == greedy
    a = generate(m, p, 6, 1 << 20, block=8, eos=(), sampling=Sampling(2.0, seed=4)).ids
    assert generate(m, p, 6, 1 << 20, block=8, eos=(), sampling=Sampling(2.0, seed=4)).ids == a
    z = np.array([[0.0, 3.0, 1.0, 2.0]])
    rng = np.random.default_rng(0)
    draws = {int(sample(z, Sampling(1.0, top_p=0.5), rng)[0]) for _ in range(50)}
    assert draws == {1}  # the likeliest token alone reaches half the mass
    assert {int(sample(z, Sampling(5.0, top_k=2), rng)[0]) for _ in range(200)} == {1, 3}


def test_a_sequence_stops_at_its_end_of_sequence_token():
    m = load_model("llama-tiny", "fp32")
    p = [[5, 6, 7], [9, 10]]
    full = generate(m, p, 8, 1 << 20, block=8, eos=()).ids
    stop = full[0][2]
    got = generate(m, p, 8, 1 << 20, block=8, eos=(stop,)).ids
    assert got[0] == full[0][: full[0].index(stop) + 1]
    cut = full[1].index(stop) + 1 if stop in full[1] else len(full[1])
    assert got[1] == full[1][:cut]


@pytest.mark.parametrize("prompts,kw,msg", [
    ([], {}, "no prompts"),
    ([[]], {}, "non-empty"),
    ([[1, 64]], {}, "token id 64 is outside the vocabulary of 64"),
    (["text"], {}, "text prompts need the model's tokenizer"),
    ([[1]], {"max_new_tokens": 0}, "max-new-tokens must be >= 1"),
    ([[1]], {"sampling": Sampling(-1.0)}, "temperature must be >= 0"),
    ([[1]], {"sampling": Sampling(1.0, top_p=0.0)}, "top-p must be in"),
])  # fmt: skip
def test_bad_input_is_one_line(prompts, kw, msg):
    with pytest.raises(GenerateError, match=msg) as e:
        generate("llama-tiny", prompts, **{"max_new_tokens": 2, "dtype": "fp32"} | kw)
    assert "\n" not in str(e.value)


def test_models_with_variations_are_refused(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mistral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "sliding_window": 8}))  # fmt: skip
    with pytest.raises(GenerateError, match="plain LLaMA layers.*window"):
        load_model(str(tmp_path), "fp32")


def test_grouped_query_llama3_tied_embeddings_equal_transformers(tmp_path):
    """LLaMA-3 layout: 4 query heads per key-value head, rope scaling, tied embeddings; prompts of 9 and 3
    tokens on two GPUs of 60 KB each (the LM head alone is 132 KB)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.test_hf_models import GQA

    cfg = transformers.LlamaConfig(**{k: v for k, v in GQA.items() if k not in ("architectures", "model_type")})
    model = random_llama(torch, transformers, cfg, 1, tmp_path)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, GQA["vocab_size"], size=n) for n in (9, 3)]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor(p)[None], max_new_tokens=32, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)  # fmt: skip
        want.append(out[0, len(p) :].tolist())
    m = load_model(str(tmp_path), "fp32")
    assert m.cfg.group == 4 and m.cfg.tie_embeddings and m.cfg.rope_scaling
    plans = PlanCache(m.cfg, 60_000, 2, "fp32", 8, verify=True)
    assert generate(m, prompts, 32, 60_000, 2, plans=plans, block=8, eos=()).ids == want


def test_cli_streams_ids_and_reports(tmp_path):
    from tests.clicall import call

    args = ["generate", "--model", "llama-tiny", "--max-new-tokens", "6", "--dtype", "fp32", "--block", "4",
            "--budget", "64KiB", "--plan-dir", str(tmp_path)]  # fmt: skip
    rc, out, err = call(args)
    assert rc == 0, err
    ids = [int(x) for x in out.split()]
    assert len(ids) == 6 and all(0 <= x < 64 for x in ids)
    lines = ("time to first token", "tokens/s", "cache buckets", "bytes moved / token", "decode step bound", "plans")
    assert all(what in err for what in lines), err
    rc, out2, err2 = call(args)
    assert rc == 0 and out2 == out and "0 built" in err2
    f = tmp_path / "p.json"
    f.write_text("[[1, 2, 3], [4, 5]]")
    rc, out, _ = call(["generate", "--model", "llama-tiny", "--prompt-ids", str(f), "--max-new-tokens", "3",
                       "--dtype", "fp32", "--plan-dir", ""])  # fmt: skip
    assert rc == 0 and [line[:4] for line in out.splitlines()] == ["[0] ", "[1] "]


@pytest.mark.parametrize("argv,msg", [
    (["--prompt", "hi"], "text prompts need the model's tokenizer"),
    (["--prompt-ids", "/nonexistent.npy"], "does not exist"),
    (["--batch", "1", "--prompt", "a", "--prompt", "b"], "smaller than the 2 prompts"),
    (["--budget", "1KiB"], "budget"),
])  # fmt: skip
def test_cli_errors_are_one_line(argv, msg):
    from tests.clicall import call

    rc, _, err = call(["generate", "--model", "llama-tiny", "--max-new-tokens", "2", "--plan-dir", "", *argv])
    assert rc in (1, 2) and msg in err and err.strip().splitlines()[-1].startswith("error: ")


def word_tokenizer(d, vocab: int) -> None:
    """A word-level ``tokenizer.json`` in ``d``: token i is the word ``w{i}``, words joined by spaces."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(d / "tokenizer.json"))


def test_text_prompts_stream_text_and_stop_at_a_stop_string(hf, tmp_path):
    """With the model's tokenizer: text in, text streamed out, a --stop string ends the sequence; the CLI's
    stream is the text of the ids that ``generate`` returns."""
    import shutil

    from tests.clicall import call

    d = tmp_path / "m"
    shutil.copytree(hf[0], d)
    word_tokenizer(d, VOCAB)
    m = load_model(str(d), "fp32")
    full = generate(m, "w5 w9 w11", 12, 1 << 20, block=8, eos=())
    assert full.text[0] == m.tokenizer.decode(full.ids[0]) and full.text[0].split()[0] == f"w{full.ids[0][0]}"
    word = full.text[0].split()[3]
    cut = generate(m, ["w5 w9 w11"], 12, 1 << 20, block=8, eos=(), stop=(word,))
    assert cut.ids[0] == full.ids[0][: full.text[0].split().index(word) + 1]
    rc, out, err = call(["generate", "--model", str(d), "--prompt", "w5 w9 w11", "--max-new-tokens", "12",
                         "--dtype", "fp32", "--block", "8", "--plan-dir", ""])  # fmt: skip
    assert rc == 0, err
    assert out.strip() == full.text[0]


def test_greedy_tokens_equal_a_numpy_llama_without_transformers():
    """``llama-tiny-gqa`` (random weights; GQA, LLaMA-3 rope, tied embeddings) against the plain numpy LLaMA
    of ``tests/test_models.py`` in float64, re-run on the whole sequence for every token."""
    from tests.test_models import numpy_llama

    base = load_model("llama-tiny-gqa", "fp32", seed=2)
    big = {k: x * (20 if x.ndim > 1 else 1) for k, x in base.weights.items()}  # past "repeat the last token"
    m = Model(base.cfg, big, lambda ids: big["tok_embed"][np.asarray(ids)], dtype="fp32")
    w = {k: x.astype(np.float64) for k, x in big.items()}
    prompts = [[7, 30, 2, 91, 15], [44], [5, 6, 7]]
    got = generate(m, prompts, 12, 1 << 20, block=4, eos=()).ids
    assert all(len(set(g)) > 3 for g in got), got
    for p, g in zip(prompts, got, strict=True):
        seq = list(p)
        for _ in range(12):
            x0 = m.embed(np.array(seq)).astype(np.float64)
            seq.append(int(numpy_llama(w, x0, m.cfg, "last")[-1].argmax()))
        assert g == seq[len(p) :]


def test_generate_benchmark_runs_on_the_cpu(tmp_path):
    """``benchmarks/generate.py``'s CPU smoke line: turnip and HF rows written, the greedy tokens agreeing."""
    pytest.importorskip("transformers")
    import csv

    from tests.benchscripts import load_script

    bench = load_script("generate")
    argv = ["--size", "tiny", "--device", "cpu", "--backend", "cpu", "--dtype", "fp32", "--rows", "2:9:8:64KiB",
            "--block", "4", "--tag", "t", "--out", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    rows = list(csv.DictReader(open(tmp_path / "generate_t.csv")))
    assert [r["system"] for r in rows] == ["turnip", "hf"]
    assert float(rows[0]["tokens_per_s"]) > 0 and int(rows[1]["tokens_agreeing_min"]) == 8
    argv = ["--size", "tiny", "--device", "cpu", "--backend", "cpu", "--dtype", "fp32", "--rows", "2:9:4:64KiB",
            "--block", "4", "--gpus", "2", "--no-hf", "--tag", "g2", "--out", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0  # turnip alone, its own random weights, two GPUs
    (row,) = csv.DictReader(open(tmp_path / "generate_g2.csv"))
    assert row["system"] == "turnip" and row["gpus"] == "2" and float(row["tokens_per_s"]) > 0
    assert row["session_kept_nbytes"] == "0"
    assert bench.main(argv[:-4] + ["--session", "--tag", "s", "--out", str(tmp_path)]) == 0  # warm-up, timed run
    (row,) = csv.DictReader(open(tmp_path / "generate_s.csv"))  # in one session: the weights found in place
    assert int(row["session_kept_nbytes"]) > 0


def test_tokens_do_not_depend_on_the_block_size():
    """One slot per block (a new plan every step) up to one block for everything: the same tokens."""
    m = load_model("llama-tiny", "fp32", seed=4)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    want = generate(m, prompts, 6, 1 << 20, block=16, eos=()).ids
    for block in (1, 3):
        assert generate(m, prompts, 6, 1 << 20, block=block, eos=()).ids == want


@pytest.mark.parametrize("rows_out", ["0", "1"])
def test_carry_of_one_row_copies_that_row_alone(monkeypatch, rows_out):
    """``backend.carry(pairs, rows=...)`` (a decode step's written slot): those rows of the output (or, from a
    step whose outputs are the new rows, ``TURNIP_DECODE_ROWS=1``, the whole output) reach the input, the
    input's other rows stay as they were; rows outside the tensor are refused."""
    from turnip.decode import carry_pairs
    from turnip.models import LLAMA
    from turnip.runtime import execute, open_backend
    from turnip.runtime.layout import row_range

    monkeypatch.setenv("TURNIP_DECODE_ROWS", rows_out)
    tg, mg = PlanCache(LLAMA["tiny"], 1 << 20, 1, "fp32", 4, None).get("decode", 2, 1)
    pairs = carry_pairs(tg)
    assert pairs
    rng = np.random.default_rng(1)
    with open_backend("cpu", mg, 2) as be:
        be.write_inputs({t: rng.standard_normal(tg.shape[t]).astype(np.float32) for t in be._inputs})
        execute(mg, be, "nondet", 2, seed=0)
        out = be.read_outputs()
        before = {i: be._host_view(be._inputs[i][0]).copy() for _, i in pairs}
        be.carry(pairs, rows=(2, 1))
        for o, i in pairs:
            after = be._host_view(be._inputs[i][0])
            np.testing.assert_array_equal(after[2], out[o][0 if rows_out == "1" else 2])
            assert (out[o].shape[0] == 1) == (rows_out == "1")
            np.testing.assert_array_equal(np.delete(after, 2, axis=0), np.delete(before[i], 2, axis=0))
    assert row_range((4, 3), 48, (1, 2)) == (12, 24) and row_range((4, 3), 48, None) == (0, 48)
    with pytest.raises(ValueError, match="outside a tensor of 4 rows"):
        row_range((4, 3), 48, (3, 2))


def test_carrying_the_written_rows_alone_keeps_the_tokens(monkeypatch):
    """Carrying the written rows alone (the default) gives the greedy tokens of carrying whole blocks
    (``TURNIP_CARRY_ROWS=0``; several blocks, a cache that spills to the host, chaos)."""
    m = load_model("llama-tiny", "fp32", seed=3)
    prompts = [[5, 7, 9, 11, 2], [3, 1, 4]]
    got = []
    for on in ("0", "1"):
        monkeypatch.setenv("TURNIP_CARRY_ROWS", on)
        assert carry_rows_on() == (on == "1")
        got.append(generate(m, prompts, max_new_tokens=9, budget="64KiB", block=4, chaos=0.2, seed=1).ids)
    assert got[0] == got[1] and all(len(x) == 9 for x in got[0])


@pytest.mark.gpu
@pytest.mark.parametrize("budget", ["64KiB", "16MiB"])
def test_cuda_backend_carries_the_written_rows_to_the_cpu_backends_tokens(monkeypatch, budget):
    """On a GPU: the CUDA backend's tokens with the written rows carried (the default) and with whole blocks
    equal the CPU backend's (a cache that spills to the host at 64 KiB, one resident on the GPU at 16 MiB)."""
    from tests.runtime.helpers import gpus

    if gpus() < 1:
        pytest.skip("needs a CUDA device")
    m = load_model("llama-tiny", "fp32", seed=3)
    prompts = [[5, 7, 9, 11, 2], [3, 1, 4]]
    want = generate(m, prompts, max_new_tokens=9, budget=budget, block=4, seed=1).ids
    got = {}
    for on in ("1", "0"):
        monkeypatch.setenv("TURNIP_CARRY_ROWS", on)
        got[on] = generate(m, prompts, max_new_tokens=9, budget=budget, block=4, backend="cuda", seed=1).ids
    assert got["1"] == got["0"] == want


@pytest.mark.parametrize("budget", ["64KiB", "16MiB"])
def test_kept_cache_blocks_keep_the_tokens(monkeypatch, budget):
    """``TURNIP_KEEP_CACHE=1``: the kept host prefix also carries the cache blocks no step writes; the next
    bucket's plan finds more bytes in place and the greedy tokens stay the same (a cache that spills at 64
    KiB, one resident at 16 MiB, chaos)."""
    m = load_model("llama-tiny", "fp32", seed=3)
    prompts = [[5, 7, 9, 11, 2, 8, 1, 6, 4], [3, 1, 4]]
    got, kept = {}, {}
    for on in ("0", "1"):
        monkeypatch.setenv("TURNIP_KEEP_WEIGHTS", "1")
        monkeypatch.setenv("TURNIP_KEEP_CACHE", on)
        r = generate(m, prompts, max_new_tokens=11, budget=budget, block=4, chaos=0.2, seed=1)
        got[on], kept[on] = r.ids, r.stats["kept_nbytes"]
    assert got["0"] == got["1"] and kept["1"] > kept["0"] > 0, kept


@pytest.mark.parametrize("budget,dtype", [("64KiB", "fp32"), ("16MiB", "fp32"), ("64KiB", "fp16")])
def test_kept_weights_keep_the_tokens(monkeypatch, budget, dtype):
    """``TURNIP_KEEP_WEIGHTS=1``: every decode plan after the first takes over the host weights of the plan
    before and the greedy tokens stay those of writing them again (several buckets, chaos, a cache that
    spills at 64 KiB)."""
    m = load_model("llama-tiny", dtype, seed=3)
    prompts = [[5, 7, 9, 11, 2, 8, 1, 6, 4], [3, 1, 4]]
    got = {}
    for on in ("0", "1"):
        monkeypatch.setenv("TURNIP_KEEP_WEIGHTS", on)
        r = generate(m, prompts, max_new_tokens=11, budget=budget, dtype=dtype, block=4, chaos=0.2, seed=1)
        got[on] = r.ids
        n_decode = sum(1 for p in r.stats["plans_built"] if p[0] == "decode")
        # every decode plan after the first (the first too where the prefill tiles its weights alike)
        assert n_decode >= 3 and r.stats["weights_kept"] >= (n_decode - 1 if on == "1" else 0), r.stats
        assert on == "1" or r.stats["weights_kept"] == 0
        ph = r.stats["prefill_phases_s"]  # the time to first token's parts
        assert set(ph) == {"open", "write", "run", "read", "assemble", "close", "fill"}, ph
        assert 0 < sum(ph.values()) <= r.stats["prefill_s"] and len(r.stats["open_s"]) == n_decode
        sw = r.stats["switch_phases_s"]  # and the bucket switches' parts
        assert set(sw) == {"read", "take", "close"} and sum(sw.values()) + sum(r.stats["open_s"][1:]) <= r.stats[
            "switch_s"] + 1e-3, (sw, r.stats)
        # the first decode plan's loading comes after the prefill's first token, apart from the bucket switches
        assert 0 < r.stats["open_s"][0] <= r.stats["first_plan_s"] < r.stats["decode_s"], r.stats
        st = r.stats["step_phases_s"]  # and the decode steps' parts, within the decode time
        assert set(st) == {"inputs", "write", "run", "read", "assemble", "carry", "sample"}, st
        # the first of the 11 tokens from the prefill, the others from decode steps
        assert r.stats["decode_steps"] == 10 and 0 < sum(st.values()) <= r.stats["total_s"]
    assert got["0"] == got["1"]


@pytest.mark.parametrize("keep_cache", ["0", "1"])
def test_a_session_hands_each_calls_weights_to_the_next(monkeypatch, keep_cache):
    """``Session``: every call gives the tokens of a call on its own (chaos, a cache that spills, several
    buckets); each call after the first finds the weights the last one left in place, with a prefill (the
    prefill plan takes them) and without one (a one-token prompt: the first decode plan does), never the cache
    blocks (``TURNIP_KEEP_CACHE=1`` keeps them within a call); a larger batch gets them too; arguments the
    session fixes are refused; ``close`` frees the region, twice is harmless."""
    from turnip.generation import Session

    monkeypatch.setenv("TURNIP_KEEP_CACHE", keep_cache)
    m = load_model("llama-tiny", "fp32", seed=3)
    prompts = [[5, 7, 9, 11, 2, 8, 1, 6, 4], [3, 1, 4]]
    one = lambda ps, n: generate(m, ps, max_new_tokens=n, budget="64KiB", block=4, chaos=0.2, seed=1)  # noqa: E731
    want = one(prompts, 11)
    assert want.stats["session_kept_nbytes"] == 0
    wide = [[1 + i % 50 for i in range(17)]] * 3
    with Session(m, budget="64KiB", block=4, chaos=0.2, seed=1) as s:
        kept = []
        for _ in range(2):
            r = s.generate(prompts, max_new_tokens=11)
            assert r.ids == want.ids
            kept.append(r.stats["session_kept_nbytes"])
        assert kept[0] == 0 and kept[1] > 0, kept
        r = s.generate(wide, max_new_tokens=5)
        assert r.ids == one(wide, 5).ids and r.stats["session_kept_nbytes"] == kept[1]
        r = s.generate([[4]], max_new_tokens=6)  # no prefill
        assert r.ids == one([[4]], 6).ids and r.stats["session_kept_nbytes"] > 0
        with pytest.raises(GenerateError, match="budget fixed by the session"):
            s.generate(prompts, budget="1MiB")
        assert s._host is not None
    assert s._host is None
    s.close()


def test_a_host_input_region_passes_to_a_plan_laid_out_alike():
    """``plan_layout(first=...)`` puts those input tensors first, in order; a detached region (``HostInputs``)
    is adopted by a backend whose prefix shares its leading tensors and is large enough, values in place; a
    backend with nothing in common, or needing more bytes, allocates its own and frees the handed one."""
    from turnip.compile import compile_model
    from turnip.generation import weight_prefix
    from turnip.runtime import open_backend
    from turnip.runtime.layout import ALIGN, buffer_view, common_prefix, plan_layout
    from turnip.runtime.weights import logical_inputs, random_inputs_for, tile_inputs

    tg, mg = compile_model("llama-tiny", 16, 1, "64KiB", dtype="fp32", resident="auto")
    names = [k for k in logical_inputs(tg) if k != "x0"]
    first, key = weight_prefix(tg, names)
    lay = plan_layout(mg, first, reserve=1000)
    offs = [lay.host_offset[mg.tensor.tolist().index(t)] for t in first]
    assert offs[0] == 0 and offs == sorted(offs) and all(o % ALIGN == 0 for o in offs)
    rest = [lay.host_offset[v] for v in range(mg.n) if lay.host_region[v] == 0 and int(mg.tensor[v]) not in first]
    assert offs[-1] < min(rest) and lay.host_input_nbytes >= plan_layout(mg).host_input_nbytes + 1000
    with pytest.raises(ValueError, match="no input with a host copy"):
        plan_layout(mg, [10**6])
    values = tile_inputs(tg, random_inputs_for(tg, seed=2))
    a = open_backend("cpu", mg, 2, host_first=first, host_key=key, host_reserve=4096)
    a.write_inputs(values)
    h = a.detach_host_inputs()
    a.close()
    assert common_prefix(h.key, key) == len(key) and common_prefix(h.key, key[:3] + (("x",),)) == 3
    assert common_prefix(h.key, (("x",),)) == 0
    b = open_backend("cpu", mg, 2, host_first=first, host_key=key, host_inputs=h)
    assert b.adopted == first
    v = mg.tensor.tolist().index(first[-1])
    got = buffer_view(b.host_in, b.lay.host_offset[v], mg.shape[v], mg.dtype[v])
    np.testing.assert_array_equal(got, np.asarray(values[first[-1]]).reshape(got.shape))
    h2 = b.detach_host_inputs()
    b.close()
    c = open_backend("cpu", mg, 2, host_first=first, host_key=key, host_reserve=1 << 20, host_inputs=h2)
    assert c.adopted == first  # a plan's own reserve is for later plans: not asked of the region it adopts
    h3 = c.detach_host_inputs()
    c.close()
    h3.array = h3.array[:1024]
    d = open_backend("cpu", mg, 2, host_first=first, host_key=key, host_inputs=h3)
    assert d.adopted == [] and h3.array is None  # too small for this layout: freed, a region of its own
    d.close()


@pytest.mark.gpu
@pytest.mark.parametrize("cache,register", [("0", "0"), ("1", "0"), ("0", "1")])
def test_cuda_backend_with_kept_weights_gives_the_cpu_backends_tokens(monkeypatch, cache, register):
    """On a GPU: decode plans taking over the pinned host weights of the plan before (``TURNIP_KEEP_WEIGHTS=1``;
    with ``TURNIP_KEEP_CACHE=1`` the unwritten cache blocks too; with ``TURNIP_HOST_REGISTER=1`` regions
    registered in place, handed over registered) give the CPU backend's tokens, and every decode plan after the
    first took them over."""
    from tests.runtime.helpers import gpus

    if gpus() < 1:
        pytest.skip("needs a CUDA device")
    m = load_model("llama-tiny", "fp32", seed=3)
    prompts = [[5, 7, 9, 11, 2, 8, 1, 6, 4], [3, 1, 4]]
    want = generate(m, prompts, max_new_tokens=11, budget="64KiB", block=4, seed=1).ids
    monkeypatch.setenv("TURNIP_KEEP_WEIGHTS", "1")
    monkeypatch.setenv("TURNIP_KEEP_CACHE", cache)
    monkeypatch.setenv("TURNIP_HOST_REGISTER", register)
    r = generate(m, prompts, max_new_tokens=11, budget="64KiB", block=4, backend="cuda", seed=1)
    assert r.ids == want and r.stats["weights_kept"] >= sum(1 for p in r.stats["plans_built"] if p[0] == "decode") - 1


@pytest.mark.gpu
@pytest.mark.parametrize("register", ["0", "1"])
def test_cuda_backend_in_a_session_gives_the_cpu_backends_tokens(monkeypatch, register):
    """On a GPU: calls of a ``Session`` (the pinned region of one call's last plan taken over by the next call's
    prefill; registered in place with ``TURNIP_HOST_REGISTER=1``) give the CPU backend's tokens, the second call
    finding the weights in place."""
    from tests.runtime.helpers import gpus
    from turnip.generation import Session

    if gpus() < 1:
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("TURNIP_HOST_REGISTER", register)
    m = load_model("llama-tiny", "fp32", seed=3)
    prompts = [[5, 7, 9, 11, 2, 8, 1, 6, 4], [3, 1, 4]]
    want = generate(m, prompts, max_new_tokens=11, budget="64KiB", block=4, seed=1).ids
    with Session(m, budget="64KiB", block=4, backend="cuda", seed=1) as s:
        runs = [s.generate(prompts, max_new_tokens=11) for _ in range(2)]
    assert [r.ids for r in runs] == [want, want]
    assert runs[0].stats["session_kept_nbytes"] == 0 < runs[1].stats["session_kept_nbytes"]


@pytest.mark.gpu
@pytest.mark.parametrize("budget", ["64KiB", "16MiB"])
@pytest.mark.parametrize("split", ["tensor", "layers"])
def test_cuda_backend_on_two_gpus_gives_the_cpu_backends_tokens(monkeypatch, budget, split):
    """On two GPUs: prefill and decode plans split over both (the cache spilling to the host at 64 KiB per GPU,
    resident at 16 MiB; decode steps by tensor or by layers) give the CPU backend's greedy tokens for the same two
    GPUs."""
    from tests.runtime.helpers import gpus

    if gpus() < 2:
        pytest.skip("needs two CUDA devices")
    monkeypatch.setenv("TURNIP_DECODE_SPLIT", split)
    m = load_model("llama-tiny", "fp32", seed=3)
    prompts = [[5, 7, 9, 11, 2, 8, 1, 6, 4], [3, 1, 4]]
    want = generate(m, prompts, max_new_tokens=11, budget=budget, gpus=2, block=4, seed=1).ids
    got = generate(m, prompts, max_new_tokens=11, budget=budget, gpus=2, block=4, backend="cuda", seed=1).ids
    assert got == want and all(len(x) == 11 for x in got)


def test_a_prefill_tiled_as_the_decode_steps_hands_its_weights_to_the_first_decode_plan(monkeypatch):
    """``TURNIP_PREFILL_DECODE_TILES=1``: the prefill tiles the weights as the decode plans do (a model wide enough
    for their tiles to differ), so the first decode plan takes over the prefill's host weights too; the greedy
    tokens stay those of a prefill tiled its own way (a cache that spills, chaos)."""
    from turnip.generation import _reference_tg, shared_weights, weight_names
    from turnip.models import LlamaConfig
    from turnip.runtime.weights import iter_random_inputs, random_embedding

    cfg = LlamaConfig(320, 6, 4, 384, vocab=64, name="llama-wide-test")
    tg = _reference_tg(cfg, "fp32")
    names = set(weight_names(cfg, "fp32"))
    m = Model(cfg, {k: x for k, x in iter_random_inputs(tg, 3) if k in names}, random_embedding(tg, 3), None, (),
              "fp32")  # fmt: skip
    prompts = [[5, 7, 9, 11, 2, 8, 1, 6, 4], [3, 1, 4]]
    monkeypatch.setenv("TURNIP_KEEP_WEIGHTS", "1")
    got, stats = {}, {}
    for on in ("0", "1"):
        monkeypatch.setenv("TURNIP_PREFILL_DECODE_TILES", on)
        plans = PlanCache(cfg, 1 << 20, 1, "fp32", 4, verify=True)
        r = generate(m, prompts, max_new_tokens=7, budget=1 << 20, dtype="fp32", block=4, plans=plans, chaos=0.2,
                     seed=1)  # fmt: skip
        got[on], stats[on] = r.ids, r.stats
        pre = next(k for k in plans.plans if k[0].startswith("prefill"))
        first = min(k for k in plans.plans if k[0] == "decode")
        share = shared_weights(m, plans.plans[pre][0], plans.plans[first][0])
        assert (share > 0.5) == (on == "1"), share
    n_decode = sum(1 for p in stats["1"]["plans_built"] if p[0] == "decode")
    assert got["0"] == got["1"]
    assert stats["1"]["weights_kept"] == n_decode == stats["0"]["weights_kept"] + 1, stats


@pytest.mark.parametrize("budget,auto", [(64 << 10, "tensor"), (16 << 20, "layers")])
def test_decode_steps_split_by_layers_give_the_same_tokens(monkeypatch, budget, auto):
    """``TURNIP_DECODE_SPLIT``: decode steps on two GPUs split by layers (a one-GPU step's tiles, each layer and its
    cache blocks on one GPU) give the tokens of the tensor split; ``auto`` takes layers where nothing then streams
    (16 MiB) and tensor where weights or cache blocks cross the host links (64 KiB). Every plan verified, chaos."""
    from turnip.compile import run_link_nbytes

    m = load_model("llama-tiny", "fp32", seed=3)
    prompts = [[5, 7, 9, 11, 2, 8, 1, 6, 4], [3, 1, 4]]
    got = {}
    for how in ("tensor", "layers", "auto"):
        monkeypatch.setenv("TURNIP_DECODE_SPLIT", how)
        plans = PlanCache(m.cfg, budget, 2, "fp32", 4, verify=True)
        got[how] = generate(m, prompts, max_new_tokens=9, budget=budget, gpus=2, block=4, plans=plans, chaos=0.2,
                            seed=1).ids  # fmt: skip
        decode = [plans.plans[k] for k in plans.plans if k[0] == "decode"]
        splits = {tg.meta["split"] for tg, _ in decode}
        assert splits == {auto if how == "auto" else how}, splits
        if how == "layers":
            assert all(set(tg.gpu.tolist()) == {0, 1} for tg, _ in decode)
            assert (max(run_link_nbytes(mg) for _, mg in decode) == 0) == (auto == "layers")
    assert got["tensor"] == got["layers"] == got["auto"]
    monkeypatch.setenv("TURNIP_DECODE_SPLIT", "rows")
    with pytest.raises(ValueError, match="TURNIP_DECODE_SPLIT='rows'"):
        PlanCache(m.cfg, budget, 2, "fp32", 4).get("decode", 2, 3)


def test_the_last_step_is_traced_where_asked(tmp_path):
    """``trace``: the last new token's decode step written as a Chrome trace, one event per vertex of its plan at
    least; the tokens are those of an untraced generation."""
    import json

    m = load_model("llama-tiny", "fp32", seed=1)
    base = generate(m, [[3, 4, 5, 6]], 5, 48_000, block=4, eos=())
    path = tmp_path / "step.json"
    got = generate(m, [[3, 4, 5, 6]], 5, 48_000, block=4, eos=(), trace=str(path))
    assert got.ids == base.ids
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("ph") == "X") >= got.stats["steps"] > 0
