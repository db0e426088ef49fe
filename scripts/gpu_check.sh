#!/usr/bin/env bash
# The GPU checks in one bounded go, for a machine with one NVIDIA GPU (docs/benchmarks/gpu.md,
# "Measured on GPU"): the gpu-marked tests, trainer MFU, the engine's decoding, the weight
# hand-off and interruptible generation on DeepSeek-R1-Distill-Qwen-1.5B's shape (random weights).
#
#     bash scripts/gpu_check.sh [SECONDS]     # logs in $OUT (default /tmp/areal-gpu-check)
#     STEPS="tests mfu" bash scripts/gpu_check.sh     # only those steps
#     PROFILE=40 STEPS=mfu16k bash scripts/gpu_check.sh  # with the 40 costliest kernels
#
# Each step has its own time limit, and all of them together SECONDS (default 570): a step
# that fails or runs out of time is reported and the next one runs. Wheels in .whl/ (for a
# machine without a package index: megatron-core, pyzmq, ...) are installed first.
set -u
BUDGET=${1:-570}
OUT=${OUT:-/tmp/areal-gpu-check}
mkdir -p "$OUT"
END=$(($(date +%s) + BUDGET))
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/areal-site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/areal-site"
fi

step() {  # step NAME LIMIT COMMAND...: run it within min(LIMIT, time left), log in $OUT/NAME.log
    local name=$1 limit=$2 left start rc
    shift 2
    [[ -z "${STEPS:-}" || " $STEPS " == *" $name "* ]] || return 0
    left=$((END - $(date +%s) - 5))
    ((left < limit)) && limit=$left
    if ((limit < 20)); then
        echo "=== $name: skipped, ${left}s left"
        return
    fi
    echo "=== $name (at most ${limit}s): $*"
    start=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "=== $name: exit $rc after $(($(date +%s) - start))s"
    grep -v -i -E "warn|^\s*$|it/s\]" "$OUT/$name.log" | tail -n "${TAIL:-14}"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers, megatron.core as m; \
print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', m.__version__)"
step tests 240 $PY -m pytest -q -s -p no:cacheprovider tests/system/test_megatron_gpu.py \
    tests/system/test_gpu_run.py tests/unit/test_logprobs.py
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # updates of varying lengths
step mfu 90 $PY benchmarks/megatron_mfu.py --tokens 8192 --seq-len 1024 --repeats 3
step mfu16k 300 $PY benchmarks/megatron_mfu.py --tokens 16384 --seq-len 2048 --repeats 3 \
    --backends torch,megatron-unfused,megatron --profile "${PROFILE:-0}"
step engine 90 $PY benchmarks/engine.py --shapes 1.5b --batch 64,256 --context-shapes "" \
    --repeats 2
step handoff 60 $PY benchmarks/handoff.py --shapes 1.5b --backend megatron --repeats 3
$PY benchmarks/shapes.py /tmp/areal-1.5b > /dev/null 2>&1
step interruptible 150 $PY benchmarks/interruptible.py --model-dir /tmp/areal-1.5b \
    --concurrency 64 --median-tokens 128 --max-tokens 1024 --update-every 4 --seconds 20 \
    --repeats "${REPEATS:-1}"
