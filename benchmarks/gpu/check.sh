#!/usr/bin/env bash
# The prepared one-GPU check (one H100/H200-class GPU, under 5 minutes, one table at the end):
#   1. the CUDA tests (pytest -m cuda: the fused varlen kernel against the reference, compiled bf16
#      blocks over varying pack lengths, ...);
#   2. a one-GPU MFU benchmark of one LLM block (dim 4096, 32/8 heads, 8192-token packs) and one ViT block
#      at bf16 with varlen attention (target >= 40% MFU on the LLM block), which also writes per-layer
#      forward/backward times as a calibration file for the pipeline simulator's cost model
#      (format: benchmarks/gpu/bench.py);
#   3. the trainer for 20 steps with pp=1 on one GPU (omni-tiny, bf16).
#
#   benchmarks/gpu/check.sh [--out DIR] [--smoke]
#
# Without a GPU it says so and exits 0. --smoke runs every step on the CPU with tiny sizes (the test suite
# does: tests/test_bench_gpu_check.py). Outputs in DIR (default runs/gpu-check-<time>): status.tsv, one log
# per step, cuda_tests.xml, bench.json, calibration.json, train/ (the run directory), table.md.
# Exit status: 0 when every check passed (or no GPU), 1 otherwise, 2 on a bad argument.
# PYTHON overrides the interpreter (default: .venv/bin/python, else `uv run --no-sync python`).
set -uo pipefail
cd "$(dirname "$0")/../.."

smoke=0
out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) smoke=1 ;;
        --out) out="${2:?--out needs a directory}"; shift ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "check.sh: unknown argument $1 (use --out DIR, --smoke)" >&2; exit 2 ;;
    esac
    shift
done

if [ -n "${PYTHON:-}" ]; then py=($PYTHON)
elif [ -x .venv/bin/python ]; then py=(.venv/bin/python)
else py=(uv run --no-sync python)
fi

if [ "$smoke" = 1 ]; then
    export CUDA_VISIBLE_DEVICES=""  # the same steps, on the CPU
    steps=2
    train_sizes=(--data.max_seq_len 128 --data.microbatches 1)
    bench_args=(--smoke)
else
    if ! "${py[@]}" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "benchmarks/gpu/check.sh: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing checked." \
             "(--smoke runs the same steps on the CPU with tiny sizes.)"
        exit 0
    fi
    steps=20
    train_sizes=()
    bench_args=()
fi

out="${out:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
: > "$out/status.tsv"

# step NAME LIMIT_S CMD...: run CMD with a time limit, its output in NAME.log; record exit status and seconds.
step() {
    local name=$1 limit=$2
    shift 2
    local t0
    t0=$(date +%s%N)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    printf '%s\t%d\t%d.%03d\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) >> "$out/status.tsv"
    if [ "$rc" != 0 ]; then
        echo "--- $name failed (exit $rc; $out/$name.log ends with):"
        tail -n 25 "$out/$name.log"
    fi
}

mapfile -t cuda_tests < <(grep -rlE --include='test_*.py' 'pytest\.mark\.cuda|pytestmark = pytest\.mark\.cuda' packages apps tests | sort)
step tests 120 "${py[@]}" -m pytest -q -m cuda -p no:cacheprovider --junitxml "$out/cuda_tests.xml" "${cuda_tests[@]}"
step bench 60 "${py[@]}" benchmarks/gpu/bench.py --out "$out" "${bench_args[@]}"
step train 110 "${py[@]}" -m omni_train.cli run --config omni-tiny --nproc 1 --parallel.pp 1 \
    --train.dtype bfloat16 --max-steps "$steps" --checkpoint.every 0 "${train_sizes[@]}" --out "$out/train"
"${py[@]}" benchmarks/gpu/report.py --out "$out"
