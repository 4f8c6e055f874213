"""llama.cpp built from a registry sdist into a cache directory, for side-by-side benchmarks.

`tools()` returns the directory holding llama-bench, llama-batched-bench, llama-quantize and
ggml-rpc-server, building them on first use from the llama.cpp sources vendored in the
llama-cpp-python sdist (pip download, ~15 min on 2 cores; never in CI). `make_variant` writes
another quantization of a GGUF with llama-quantize, cached beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # vendors llama.cpp with ggml 0.25.x
CACHE = Path(os.environ.get("MESHLLM_CACHE_DIR", Path.home() / ".cache" / "meshllm"))
ROOT = CACHE / "llama.cpp"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize", "ggml-rpc-server")


def tools() -> Path:
    bin_dir = ROOT / f"build-{LLAMA_CPP_PYTHON}" / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    src = ROOT / f"src-{LLAMA_CPP_PYTHON}"
    if not src.exists():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], check=True)
            with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
                tar.extractall(tmp, filter="data")
            ROOT.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp").rename(src)
    build = ROOT / f"build-{LLAMA_CPP_PYTHON}"
    print(f"building llama.cpp {LLAMA_CPP_PYTHON} into {build} (~15 min on 2 cores) ...", file=sys.stderr)
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DGGML_RPC=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build), "-j2", "--target", *TARGETS], check=True)
    return bin_dir


def make_variant(source: Path, kind: str) -> Path:
    """`source` requantized to `kind` (BF16, Q8_0, Q4_0, ...) by llama-quantize, cached."""
    out = CACHE / "bench" / f"{source.stem}.{kind}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(tools() / "llama-quantize"), "--allow-requantize", str(source), str(tmp), kind, "2"],
                       check=True, capture_output=True)
        tmp.rename(out)
    return out


def _run_json(args: list[str]) -> tuple[list[dict], int]:
    """Run a llama.cpp tool, parse its JSON (or JSON lines) output; also its peak RSS in bytes
    (GNU time's %M: the tool maps the file, so this counts the weights it touched)."""
    done = subprocess.run(["/usr/bin/time", "-f", "MAXRSS_KIB %M", *args], check=True, capture_output=True, text=True)
    peak_kib = int(next(line.split()[1] for line in done.stderr.splitlines() if line.startswith("MAXRSS_KIB")))
    text = done.stdout.strip()
    rows = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines()
                                                           if line.startswith("{")]
    return rows, peak_kib * 1024


def bench(model: Path, threads: int, prefill: int, decode: int, repeats: int = 3) -> dict:
    """llama-bench decode (batch 1) and prefill tok/s, and llama-batched-bench at batch 8."""
    rows, rss = _run_json([str(tools() / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(prefill),
                           "-n", str(decode), "-r", str(repeats), "-o", "json"])
    figures = {}
    for r in rows:
        if r["n_gen"] and not r["n_prompt"]:
            figures["decode_tok_s"] = round(r["avg_ts"], 2)
        elif r["n_prompt"] and not r["n_gen"]:
            figures["prefill_tok_s"] = round(r["avg_ts"], 1)
    batched, rss8 = _run_json([str(tools() / "llama-batched-bench"), "-m", str(model), "-t", str(threads),
                               "-c", "2048", "-npp", "32", "-ntg", str(decode), "-npl", "8", "-fa", "on",
                               "--output-format", "jsonl"])
    figures["decode_batch8_tok_s"] = round(batched[0]["speed_tg"], 2)
    figures["peak_rss_mib"] = round(max(rss, rss8) / 2**20, 1)
    return figures
