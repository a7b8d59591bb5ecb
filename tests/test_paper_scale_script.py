"""``benchmarks/paper_scale.py``'s baselines on the CPU (a tiny model): Accelerate's pipeline, PEFT's LoRA step on
it, DeepSpeed ZeRO-Inference under torchrun where deepspeed is installed, and the comparison tables."""

import csv

import pytest

from tests.benchscripts import load_script

pytestmark = pytest.mark.unit


def test_tables_pair_each_turnip_row_with_its_baselines(capsys):
    ps = load_script("paper_scale")
    ps.print_tables([
        {"system": "turnip", "workload": "prefill", "seq": 4096, "batch": 1, "budget": "16GiB", "policy": "nondet",
         "ms_median": 700.0},
        {"system": "accelerate", "seq": 4096, "batch": 1, "budget": "16GiB", "ms_median": 28000.0},
        {"system": "accelerate", "seq": 4096, "batch": 1, "budget": "30GiB", "ms_median": 13000.0},
        {"system": "deepspeed-zero-inference", "seq": "4096", "batch": "1", "ms_median": "3500.0"},  # as read back
        {"system": "turnip", "workload": "lora", "seq": 1024, "batch": 8, "ms_median": 6000.0},
        {"system": "peft", "workload": "lora", "seq": 1024, "batch": 8, "ms_median": 18000.0},
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert "| 4096 | 1 | 16GiB | nondet | 700.0 | 28000.0 | 40.00x | 3500.0 | 5.00x |" in out
    assert "| 8 x 1024 | 6000.0 | 18000.0 | 3.00x |" in out


def test_accelerate_and_peft_rows_run_on_the_cpu(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("accelerate")
    ps = load_script("paper_scale")
    loads, load = [], ps.random_offloaded_llama
    ps.random_offloaded_llama = lambda *args: loads.append(args[2]) or load(*args)
    assert ps.main(["--model", "llama-tiny", "--gpus", "0", "--no-turnip", "--prompts", "32", "16x2", "--budgets",
                    "none", "--no-limit-baseline", "--peft", "2x32", "--steps", "2", "--repeat", "1",
                    "--out", str(tmp_path)]) == 0  # fmt: skip
    rows = list(csv.DictReader(open(tmp_path / "paper_scale.csv")))
    acc, acc2, peft = rows
    for r in (acc, acc2):
        assert r["system"] == "accelerate" and float(r["ms_median"]) > 0 and not r.get("error")
    assert (acc2["seq"], acc2["batch"]) == ("16", "2") and len(loads) == 2  # one load for both prompts, one PEFT's
    assert peft["system"] == "peft" and float(peft["ms_median"]) > 0
    losses = [float(x) for x in peft["losses"].split()]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)


def test_zero_inference_config_is_stage_3_offloaded():
    zi = load_script("zero_inference")
    c = zi.ds_config(8192)
    z = c["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert c["fp16"] == {"enabled": True} and z["stage3_param_persistence_threshold"] == 81920
    assert "bf16" in zi.ds_config(64, pin=False, dtype="bf16")


def test_deepspeed_rows_run_under_torchrun_on_the_cpu(tmp_path):
    pytest.importorskip("deepspeed")
    ps = load_script("paper_scale")
    assert ps.main(["--model", "llama-tiny", "--gpus", "0", "--no-turnip", "--no-accelerate", "--prompts", "32",
                    "--deepspeed", "--repeat", "1", "--out", str(tmp_path)]) == 0  # fmt: skip
    (row,) = list(csv.DictReader(open(tmp_path / "paper_scale.csv")))
    assert row["system"] == "deepspeed-zero-inference" and not row.get("error"), row
    assert float(row["ms_median"]) > 0 and row["seq"] == "32"


def test_turnip_rows_are_written_before_the_baseline_of_their_prompt_runs(tmp_path, monkeypatch):
    """A baseline row that does not finish (here: fails) loses no turnip row measured before it."""
    ps = load_script("paper_scale")
    import multi_gpu  # the sibling script paper_scale.py takes its rows from

    monkeypatch.setattr(multi_gpu, "prefill_row", lambda a, seq, budget, gpus, split, batch=1: [
        {"workload": "prefill", "seq": seq, "batch": batch, "budget": budget, "policy": "nondet", "ms_median": 1.0}])

    class Slow:
        def __init__(self, *args):
            pass

        def row(self, seq, batch):
            raise TimeoutError("the call's time is up")

    monkeypatch.setattr(ps, "AccelerateModel", Slow)
    with pytest.raises(TimeoutError):
        ps.main(["--model", "llama-tiny", "--gpus", "0", "--prompts", "32", "--budgets", "1MiB", "--lora",
                 "--no-limit-baseline", "--out", str(tmp_path)])  # fmt: skip
    rows = list(csv.DictReader(open(tmp_path / "paper_scale.csv")))
    assert [(r["system"], r["seq"], r["ms_median"]) for r in rows] == [("turnip", "32", "1.0")]
