#!/usr/bin/env bash
# Several GPUs of one server: the checks and measurements of the multi-GPU work, in calls that fit a 10-minute
# limit (run from the repository root on the GPU machine; wheels for cuDNN's frontend in .whl/).
#   bash benchmarks/multi_gpu_checks.sh OUT diag     # ~4 min: where multi-GPU processes end badly, host link totals
#   bash benchmarks/multi_gpu_checks.sh OUT tests    # GPU tests on every GPU (1, 2, 4)
#   bash benchmarks/multi_gpu_checks.sh OUT prefill  # 7B prefill on 1, 2, 4 GPUs: splits, policies, reproducibility
#   bash benchmarks/multi_gpu_checks.sh OUT lora     # 7B LoRA steps on 1, 2, 4 GPUs, exit codes
#   bash benchmarks/multi_gpu_checks.sh OUT paper    # LLaMA-65B against HF Accelerate on 4 GPUs (long: pick rows)
#   bash benchmarks/multi_gpu_checks.sh OUT tampered # tampered plan files under compute-sanitizer: refused
#   bash benchmarks/multi_gpu_checks.sh OUT dispatch # host dispatch variants on 1, 2, 4 GPUs (benchmarks/dispatch.py)
#   bash benchmarks/multi_gpu_checks.sh OUT families # the Hugging Face families on two physical GPUs
#   bash benchmarks/multi_gpu_checks.sh OUT prompts  # batch-64 generation, prompts packed (TURNIP_PACK_PROMPTS) or not
#   bash benchmarks/multi_gpu_checks.sh OUT ports    # NVLink ports (linkprobe --p2p), two traced 4-GPU tensor-split cells
#   bash benchmarks/multi_gpu_checks.sh OUT carry    # batch-64 generation, the cache carried by written rows or whole
#                                                    # blocks (TURNIP_CARRY_ROWS); a 7B row of batch 64 takes ~4.5 min
#                                                    # on an H100 (weights 55 s, a 2-token warm-up 125 s, the row)
#   bash benchmarks/multi_gpu_checks.sh OUT load     # LLaMA-65B loaded on 4 GPUs: plain memory registered while it
#                                                    # is filled (TURNIP_PIN_WHILE_FILLING=1), after it, or pinned
#                                                    # memory allocated (TURNIP_HOST_REGISTER=0): load_s in parts
#   bash benchmarks/multi_gpu_checks.sh OUT gen65    # LLaMA-65B generation on 4 GPUs, batch 16, 30 GiB per GPU, the
#                                                    # warm-up and timed calls in one Session, outputs read by a
#                                                    # thread per GPU (TURNIP_PARALLEL_READS=1) and not
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}
what=${2:?diag, tests, prefill, lora, paper, dispatch, tampered, families, prompts, ports, carry, load or gen65}
mkdir -p "$out"
if [ -d .whl ] && ! python3 -c "import cudnn" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=".:/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(nvidia-smi -L | wc -l)
case "$what" in
diag)
    nvidia-smi topo -m > "$out/topo.txt" 2>&1; head -6 "$out/topo.txt"
    echo "== numba kernel on two devices"
    PYTHONFAULTHANDLER=1 timeout 120 python3 benchmarks/exit_check.py numba --gpus 2 > "$out/numba.log" 2>&1
    echo "rc $?"; tail -8 "$out/numba.log"
    echo "== training in process, teardown step by step (MALLOC_CHECK_=3)"
    PYTHONFAULTHANDLER=1 MALLOC_CHECK_=3 timeout 200 python3 benchmarks/exit_check.py probe --gpus 2 > "$out/probe.log" 2>&1
    echo "rc $?"; grep -v "^step\|it/s" "$out/probe.log" | tail -30
    echo "== host link totals"
    timeout 120 python3 -m turnip.linkprobe --gpus "$ngpu" --json "$out/links.json" > "$out/links.log" 2>&1
    echo "rc $?"; tail -8 "$out/links.log"
    echo "== CLI runs in subprocesses"
    timeout 300 python3 benchmarks/exit_check.py cmds --gpus 2 --out "$out/exit.csv" 2>&1 | tee "$out/exit.log"
    ;;
tests)
    timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/runtime tests/test_train.py tests/test_generation.py \
        > "$out/tests.log" 2>&1
    echo "rc $?"; tail -15 "$out/tests.log"
    ;;
prefill)
    timeout 560 python3 benchmarks/multi_gpu.py --gpus 1 2 4 --rows ${ROWS:-4096:none 4096:6GiB} \
        --splits ${SPLITS:-tensor layers} --out "$out" --tag _prefill 2>&1 | tee "$out/prefill.log" | tail -40
    ;;
lora)
    timeout 560 python3 benchmarks/multi_gpu.py --gpus 1 2 4 --rows --lora ${LORA:-8x1024:16GiB} \
        --splits ${SPLITS:-data layers} --out "$out" --tag _lora 2>&1 | tee "$out/lora.log" | tail -30
    ;;
families)
    timeout 560 python3 benchmarks/hf_check.py --models mistral-swa qwen2-small qwen3-small phi3-small gemma-small \
        gemma2-small --gpus 2 --budget 256MiB --out "$out" --tag hf_families_2gpu 2>&1 | tee "$out/families.log" | tail -20
    ;;
prompts)
    for pack in 1 0; do
        TURNIP_PACK_PROMPTS=$pack timeout 285 python3 benchmarks/generate.py --rows ${ROWS:-64:512:8:6GiB} --no-hf \
            --out "$out" --tag "prompts_pack$pack" 2>&1 | tee "$out/prompts_pack$pack.log" | tail -4
    done
    ;;
carry)
    for rows in 0 1; do
        TURNIP_PACK_PROMPTS=1 TURNIP_CARRY_ROWS=$rows timeout 285 python3 benchmarks/generate.py \
            --rows ${ROWS:-64:512:8:6GiB} --no-hf --out "$out" --tag "carry_rows$rows" 2>&1 | tee "$out/carry_rows$rows.log" | tail -4
    done
    ;;
paper)
    timeout 590 python3 benchmarks/paper_scale.py --gpus "$ngpu" ${PAPER:-} --out "$out" 2>&1 | tee "$out/paper.log" | tail -30
    ;;
dispatch)
    timeout 560 python3 benchmarks/dispatch.py --rows ${ROWS:-4096:none:1 4096:none:2 4096:none:4 16384:none:4} \
        --out "$out" 2>&1 | tee "$out/dispatch.log" | grep -v "^ *[0-9].* GPU .*base" | tail -60
    ;;
tampered)
    python3 benchmarks/tampered_plans.py make "$out/plans" && timeout 400 python3 benchmarks/tampered_plans.py check \
        "$out/plans" 2>&1 | tee "$out/tampered.log"
    ;;
ports)
    timeout 120 python3 -m turnip.linkprobe --gpus "$ngpu" --p2p --json "$out/links_ports.json" > "$out/ports.log" 2>&1
    echo "rc $?"; tail -10 "$out/ports.log"
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/machine/test_linkprobe.py 2>&1 | tail -2
    for c in 4096:6GiB 16384:1GiB; do
        n="p${c/:/_}_4"
        timeout 120 python3 -c "import sys; from turnip.cli import main; sys.exit(main(sys.argv[1:]))" compile \
            --model llama-7b --seq "${c%%:*}" --gpus 4 --budget "${c##*:}" --split tensor --resident auto -o "/tmp/$n.plan" \
            > /dev/null && timeout 150 python3 -c "import sys; from turnip.cli import main; sys.exit(main(sys.argv[1:]))" \
            run "/tmp/$n.plan" --backend cuda --repeat 3 --warmup 1 --trace "/tmp/$n.real.json" > "$out/$n.log" 2>&1
        echo "$n rc $?"; grep -E "time to first|host cost" "$out/$n.log"
    done
    tar -czf "$out/traces.tgz" -C /tmp $(cd /tmp && ls p*_4.plan p*_4.real.json 2>/dev/null)
    ;;
load)
    for how in fill1 reg1 fill1 reg0; do  # registered and pinned while filled, after; allocated pinned
        reg=1; [ "$how" = reg0 ] && reg=0
        fill=0; [ "$how" = fill1 ] && fill=1
        TURNIP_HOST_REGISTER=$reg TURNIP_PIN_WHILE_FILLING=$fill timeout 140 python3 benchmarks/multi_gpu.py \
            --model llama-65b --gpus 4 --rows ${ROWS:-1024:30GiB} --splits tensor --policies nondet --repeat 2 \
            --out "$out" --tag "_load_$how" 2>&1 | tee -a "$out/load_$how.log" | grep "^prefill "
    done
    ;;
gen65)
    for reads in 1 0; do
        TURNIP_PARALLEL_READS=$reads timeout 275 python3 benchmarks/generate.py --size 65b --gpus 4 \
            --rows ${ROWS:-16:512:16:30GiB} --no-hf --session --out "$out" --tag "gen65b_reads$reads" 2>&1 \
            | tee "$out/gen65b_reads$reads.log" | tail -3
    done
    ;;
*)
    echo "unknown step $what" >&2
    exit 2
    ;;
esac
