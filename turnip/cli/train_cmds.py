"""``turnip train``: LoRA fine-tuning under a GPU memory budget, one compiled plan per training step."""

from __future__ import annotations

import time

from turnip.cli import DefaultsHelp, format_nbytes
from turnip.cli import args as ck


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="LoRA fine-tuning under a memory budget: forward, backward and Adam as one plan per step",
        description="Compile one LoRA training step of a LLaMA-family model (forward, next-token cross-entropy "
        "over the vocabulary, backward to the adapters, an Adam step on them) into a plan under --budget, then "
        "run it --steps times on batches of --batch sequences of --seq tokens: token ids from --data (a .npy "
        "of token ids, or a text file tokenized with the model directory's tokenizer.json), random ids without "
        "it. Frozen weights: a Hugging Face model directory (--model DIR; one without safetensors files needs "
        "--random-weights), --weights FILE.safetensors, or random (--seed). Prints the loss and the time of "
        "every step; --out DIR saves the adapters as a PEFT adapter directory (PeftModel.from_pretrained loads it).",
        formatter_class=DefaultsHelp,
    )
    _add_args(p)
    p.set_defaults(func=cmd_train)


def _add_args(p) -> None:
    from turnip.cli.run_cmds import add_random_weights_flag
    from turnip.compile import MODEL_HELP
    from turnip.runtime import BACKENDS
    from turnip.sched import POLICIES

    p.add_argument("--model", default="llama-tiny", type=ck.model, metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--seq", type=ck.int_in(2), default=64, help="tokens per sequence")
    ck.add_train_flags(p, always=True)
    p.add_argument("--steps", type=ck.COUNT, default=10, help="training steps")
    p.add_argument("--data", metavar="FILE", help="token ids (.npy, 1-D stream or 2-D rows) or a text file")
    p.add_argument("--budget", default="6GiB", help="GPU memory budget per GPU")
    p.add_argument("--gpus", type=ck.GPUS, default=1, help="GPUs (1..8)")
    p.add_argument("--dtype", default="fp16", choices=ck.DTYPES, help="compute dtype of the frozen model")
    p.add_argument("--layers", type=ck.COUNT, default=None, help="first N decoder layers only")
    ck.add_split_flag(p)
    p.add_argument("--tile", action="append", default=[], metavar="DIM=SIZE", help="tile override: h or f")
    p.add_argument("--resident", default="auto", help="bytes of inputs kept on the GPU across steps, or 'auto'")
    p.add_argument("--workspace", default="auto", help="kernel scratch per stream slot (cuDNN attention backward)")
    p.add_argument("--backend", default="cpu", choices=BACKENDS,
                   help="cpu: numpy on byte arenas with real threads (any machine); cuda: the GPU")
    p.add_argument("--policy", default="nondet", choices=POLICIES, help="dispatch policy")
    p.add_argument("--streams", type=ck.int_in(1, 64), default=5, help="stream slots per GPU (1..64)")
    p.add_argument("--unordered-sums", action="store_true",
                   help="partial sums added in the order they finish: not bitwise reproducible across runs on 3+ GPUs")
    p.add_argument("--weights", metavar="FILE.safetensors", help="frozen weights from this file")
    add_random_weights_flag(p)
    p.add_argument("--seed", type=ck.SEED, default=0, help="weights, adapters and random data seed")
    ck.add_runtime_flags(p, stall_s=120.0)
    p.add_argument("--out", metavar="DIR", help="save the trained adapters here (PEFT format)")
    p.add_argument("--csv", metavar="OUT.csv", help="one row per step: loss, makespan, wall time")
    p.add_argument("--force", action="store_true", help="compile even when the plan is very large")


class Batches:
    """Batches (B, S) of token ids: consecutive windows of a token stream (wrapping around), or random."""

    def __init__(self, ids, batch: int, seq: int, vocab: int, seed: int):
        import numpy as np

        self.b, self.s, self.vocab = batch, seq, vocab
        self.rng = np.random.default_rng([seed, 7])
        self.ids = None if ids is None else np.asarray(ids, dtype=np.int64).reshape(-1)
        self.pos = 0

    def next(self):
        n = self.b * self.s
        if self.ids is None:
            return self.rng.integers(0, self.vocab, size=(self.b, self.s))
        import numpy as np

        idx = (self.pos + np.arange(n)) % self.ids.size
        self.pos = int((self.pos + n) % self.ids.size)
        return self.ids[idx].reshape(self.b, self.s)


def _data(a, vocab: int):
    """Token ids of --data (None: random ids)."""
    import numpy as np

    if not a.data:
        return None
    if a.data.endswith(".npy"):
        ids = ck.token_ids_file(a.data, "--data", "integer token ids (at least 2)", lambda ids: ids.size >= 2)
    else:
        ck.input_file(a.data, "--data", "pass a .npy of token ids or a text file")
        from turnip.cli.run_cmds import _tokenizer

        tok = _tokenizer(a, required=False)
        if tok is None:
            raise ck.CliError(f"--data {a.data}: a text file needs the model directory's tokenizer.json and the "
                              "tokenizers package; or pass token ids as .npy", ck.USAGE)  # fmt: skip
        with open(a.data, encoding="utf-8", errors="replace") as f:
            ids = np.array(tok.encode(f.read()).ids, dtype=np.int64)
    from functools import partial

    from turnip.runtime.weights import check_ids

    return check_ids(ids, vocab, f"--data {a.data} (vocabulary of {vocab})", partial(ck.CliError, code=ck.USAGE))


def _embedder(tg, seed: int, ckpt):
    """``ids -> x0`` for the batches: the checkpoint's embedding rows, or the random weights' (made once)."""
    from turnip.runtime.weights import random_embedding

    if ckpt is None:
        return random_embedding(tg, seed)

    def rows(ids):
        return next(x for name, x in ckpt.iter_inputs(tg, ids=ids, seed=seed, only={"x0"}) if name == "x0")

    return rows


def cmd_train(a) -> int:
    """Compile, load and run ``a.steps`` training steps."""
    import numpy as np

    from turnip.cli.compile_cmds import build_plan, compile_args
    from turnip.cli.run_cmds import _checkpoint, _cuda_preflight
    from turnip.fileio import atomic_write
    from turnip.progress import Progress
    from turnip.runtime import open_backend
    from turnip.runtime.weights import vocab_size, write_random_inputs, write_streaming
    from turnip.train import AdapterState, Stepper, next_token_targets, save_adapters

    if a.backend == "cuda":
        _cuda_preflight()
    ck.output_file(a.csv, "--csv")
    if a.out:
        ck.output_file(a.out, "--out")  # its parent must exist and be writable; the directory is made at the end
        ck.output_dir(a.out, "--out")  # and it must not be an existing file
    a.plan, a.train, a.logits = None, "lora", None
    ckpt = _checkpoint(a)
    t0 = time.perf_counter()
    tiles, budget, est = compile_args(a, a.force, extra_nbytes=lambda e: e.input_nbytes)
    tg, mg = build_plan(a, tiles, budget, est, seed=a.seed, label="plan")
    tr = tg.meta["train"]
    vocab = vocab_size(tg)
    batches = Batches(_data(a, vocab), a.batch, a.seq, vocab, a.seed)
    state = AdapterState.init(tg, a.seed)
    per_step = set(state.inputs()) | {"x0", "targets"}
    t_plan = time.perf_counter() - t0
    opts = ({"chaos": a.chaos} if a.backend == "cpu" else {}) | {"groups": ck.GROUPS[a.launch_groups]}
    rows = []
    peak = format_nbytes(max(mg.stats.get("peak_nbytes_per_gpu", [0])))
    print(f"LoRA rank {tr['lora']['rank']} on {','.join(tr['lora']['targets'])} of {tr['n_layers']} layers: "
          f"{sum(x.size for x in state.params.values()):,} trainable values; checkpointing "
          f"{'on' if tr['checkpoint'] else 'off'}; {mg.n:,} vertices, peak {peak} per GPU under "
          f"{format_nbytes(budget)}")  # fmt: skip
    t1 = time.perf_counter()
    with open_backend(a.backend, mg, a.streams, **opts) as be:
        frozen = set(tg.meta["input_blocks"]) - per_step
        t2 = time.perf_counter()
        if ckpt is not None:
            nbytes = write_streaming(be, tg, ckpt.inputs(tg, seed=a.seed, only=frozen))  # read on threads
        else:
            nbytes = write_random_inputs(be, tg, a.seed, skip=per_step)
        t_write = time.perf_counter() - t2
        stepper = Stepper(tg, mg, be, state)
        embed = _embedder(tg, a.seed, ckpt)
        t_load = time.perf_counter() - t1
        print(f"plan {t_plan:.1f} s, load {t_load:.1f} s (weights {nbytes / 1e9:.3g} GB at "
              f"{nbytes / 1e9 / max(t_write, 1e-9):.3g} GB/s); backend {a.backend}, policy {a.policy}")
        with Progress(a.steps, "train") as bar:
            for step in range(a.steps):
                w0 = time.perf_counter()
                ids = batches.next()
                x0 = embed(ids.reshape(-1))
                loss, res, _ = stepper.step(x0, next_token_targets(ids), a.policy, a.streams, a.seed + step, a.stall_s,
                                             ordered_sums=not a.unordered_sums)
                wall = time.perf_counter() - w0
                rows.append({"step": step + 1, "loss": loss, "makespan_ms": res.makespan_ns / 1e6,
                             "wall_ms": wall * 1e3, "policy": a.policy, "backend": a.backend})  # fmt: skip
                bar.update(step + 1)
                print(f"step {step + 1:>4}/{a.steps}  loss {loss:.4f}  step {res.makespan_ns / 1e6:9.1f} ms  "
                      f"(wall {wall * 1e3:.1f} ms)", flush=True)
                if not np.isfinite(loss):
                    raise ck.CliError(f"the loss is {loss} at step {step + 1}; lower --lr", ck.FAILED)
        state = stepper.fetch()
    ms = sorted(r["makespan_ms"] for r in rows)
    tokens = a.batch * a.seq
    print(f"median step {ms[len(ms) // 2]:.1f} ms ({tokens / ms[len(ms) // 2] * 1e3:,.0f} tokens/s); loss "
          f"{rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}")  # fmt: skip
    if a.csv:
        import pandas as pd

        with atomic_write(a.csv, newline="") as f:
            pd.DataFrame(rows).to_csv(f, index=False)
        print(f"csv       {a.csv}")
    if a.out:
        save_adapters(a.out, state, tg, base_model=str(a.model))
        print(f"adapters  {a.out} (PEFT: PeftModel.from_pretrained(model, {a.out!r}))")
    return 0
