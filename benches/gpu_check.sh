#!/usr/bin/env bash
# One pass of the GPU checks: the CUDA tests, the GPU benchmarks (GPT-2 large, then U-Net and
# ResNet+BN large, then third-party models at 50%) and the rest of the test suite, each under
# its own time limit so that one stage that runs long still leaves the others their turn.
#
#   bash benches/gpu_check.sh OUTDIR [SIZE]     # SIZE: large (default) or tiny (a dry run)
#
# Logs and bench.json files land in OUTDIR. Run from the repository root with hrockmate
# importable (installed, or PYTHONPATH=python with the native module built in place).
set -u
out=${1:?usage: gpu_check.sh OUTDIR [SIZE]}
size=${2:-large}
device=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HROCKMATE_CACHE_DIR=off
py=${PYTHON:-python3}

stage() {  # stage NAME SECONDS CMD...: run CMD under a time limit, log to OUTDIR/NAME.log
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s)"
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    tail -n 25 "$out/$name.log"
}

stage env 60 "$py" -c "
import torch, highspy, hrockmate
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device',
      torch.cuda.get_device_name() if torch.cuda.is_available() else None)
print('highspy', highspy.__file__, 'hrockmate', hrockmate.__file__)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null

stage cuda_tests 150 "$py" -m pytest -q -m cuda -p no:cacheprovider tests
stage bench_gpt2 240 "$py" -m hrockmate bench --device "$device" --size "$size" --models gpt2 \
    --budgets 0.9,0.7,0.5,0.3 --methods plain,hrockmate,checkpoint,selective \
    --time-limit 60 --threads 0 --no-plot --out "$out/gpt2"
stage bench_unet_resnet 180 "$py" -m hrockmate bench --device "$device" --size "$size" \
    --models unet,resnet_bn --budgets 0.9,0.7,0.5,0.3 --methods plain,hrockmate,checkpoint,selective \
    --time-limit 60 --threads 0 --no-plot --out "$out/unet_resnet"
stage thirdparty 150 "$py" benches/thirdparty.py --device "$device" --size small \
    --models gpt2,llama,bert,t5,vit,resnet18 --budgets 0.5 --threads 0 --out "$out/thirdparty.json"
# the rest of the suite, with the GPU present (a model may land on it), on the many cores
# (pytest-xdist); SUITE_SECONDS=0 skips it
if [ "${SUITE_SECONDS:-150}" -gt 0 ]; then
    workers=$("$py" -c "import os; print(max(1, min(12, os.cpu_count() - 2)))")
    stage suite "${SUITE_SECONDS:-150}" "$py" -m pytest -q -x -p no:cacheprovider \
        -n "$workers" -m "not cuda" tests
fi
