#!/usr/bin/env bash
# Two GPUs (an NVLinked pair): what the simulator's two-GPU cells need, in calls that fit a 10-minute limit.
#   bash benchmarks/pair_checks.sh OUT_DIR calibrate   # ~5 min: two-GPU GPU tests, `turnip calibrate --p2p`
#                                                      #   (peer copies by size), traced 1K and 4K cells on 2 GPUs
#   bash benchmarks/pair_checks.sh OUT_DIR grid        # ~8 min: the 60-cell grid on 2 GPUs (run right after)
# OUT_DIR: tests.log, cal.json + cal.log, traced.csv + traces.tgz (one trace per cell and policy), grid.csv.
# Then, anywhere: python benchmarks/sim_vs_real.py compare OUT_DIR/grid.csv --profile OUT_DIR/cal.json --out ...
# and, after `tar xzf OUT_DIR/traces.tgz`, compare OUT_DIR/traced.csv --profile OUT_DIR/cal.json --traces traces.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}
what=${2:?calibrate or grid}
mkdir -p "$out"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
case "$what" in
calibrate)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_cuda.py -k two_gpu > "$out/tests.log" 2>&1
    tail -3 "$out/tests.log"
    timeout 240 python3 -c "import sys; from turnip.cli import main; sys.exit(main(sys.argv[1:]))" \
        calibrate --p2p -o "$out/cal.json" > "$out/cal.log" 2>&1
    grep -i "peer\|host \|links" "$out/cal.log"
    tmp=$(mktemp -d)
    timeout 220 python3 benchmarks/sim_vs_real.py measure --gpus 2 --seqs 1024 4096 --out "$out/traced.csv" \
        --traces "$tmp/traces" > "$out/traced.log" 2>&1
    tail -2 "$out/traced.log"
    tar czf "$out/traces.tgz" -C "$tmp" traces && rm -rf "$tmp"
    ;;
grid)
    timeout 560 python3 benchmarks/sim_vs_real.py measure --gpus 2 --out "$out/grid.csv" > "$out/grid.log" 2>&1
    tail -2 "$out/grid.log"
    ;;
*)
    echo "unknown step $what (calibrate or grid)" >&2
    exit 2
    ;;
esac
