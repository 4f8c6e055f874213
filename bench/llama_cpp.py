"""llama.cpp built from a registry sdist into a cache directory, for side-by-side benchmarks.

`tools()` returns the directory holding llama-bench, llama-batched-bench, llama-quantize and
ggml-rpc-server, building them on first use from the llama.cpp sources vendored in the
llama-cpp-python sdist (pip download, ~15 min on 2 cores; never in CI). `make_variant` writes
another quantization of a GGUF with llama-quantize, cached beside it. `rpc_servers` and
`rpc_bench` measure llama.cpp's RPC mode (layers split over ggml-rpc-server processes), the
peer of a meshllm pipeline.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # vendors llama.cpp with ggml 0.25.x
CACHE = Path(os.environ.get("MESHLLM_CACHE_DIR", Path.home() / ".cache" / "meshllm"))
ROOT = CACHE / "llama.cpp"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize", "ggml-rpc-server")


def _cpu_has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# ggml's AMX matmul segfaults on the first multi-row product on some AMX CPUs (seen here on a
# KVM Xeon; upstream llama.cpp issue #20824, closed unfixed), which kills llama-bench. There the
# build leaves AMX out (GCC's explicit -mno-* flags win over -march=native) and keeps every other
# kernel of the native build, CPU_REPACK included: the fastest llama.cpp that runs on that machine.
NO_AMX = _cpu_has_amx()
BUILD_NAME = f"build-{LLAMA_CPP_PYTHON}" + ("-noamx" if NO_AMX else "")


def tools() -> Path:
    bin_dir = ROOT / BUILD_NAME / "bin"
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
    build = ROOT / BUILD_NAME
    print(f"building llama.cpp {LLAMA_CPP_PYTHON} into {build} (~15 min on 2 cores) ...", file=sys.stderr)
    no_amx = "-mno-amx-int8 -mno-amx-tile -mno-amx-bf16"
    flags = [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"] if NO_AMX else []
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DGGML_RPC=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF", *flags], check=True)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def rpc_servers(cores: list[int | None], threads: int = 1,
                timeout_s: float = 30.0) -> Iterator[list[tuple[str, int]]]:
    """One ggml-rpc-server per entry of `cores` on loopback, `threads` compute threads each,
    pinned to that core with taskset (None: not pinned); yields their (host:port, pid) and stops
    them (by pid) on exit."""
    processes: list[subprocess.Popen] = []
    addresses: list[str] = []
    try:
        for core in cores:
            port = _free_port()
            pin = ["taskset", "-c", str(core)] if core is not None else []
            processes.append(subprocess.Popen([*pin, str(tools() / "ggml-rpc-server"), "-H", "127.0.0.1",
                                               "-p", str(port), "-t", str(threads)],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            addresses.append(f"127.0.0.1:{port}")
        deadline = time.monotonic() + timeout_s
        for process, address in zip(processes, addresses):
            _wait_listening(process, address, deadline)
        yield [(a, p.pid) for a, p in zip(addresses, processes)]
    finally:
        for process in processes:  # taskset execs the server: each pid is the server itself
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_listening(process: subprocess.Popen, address: str, deadline: float) -> None:
    host, port = address.split(":")
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"ggml-rpc-server at {address} exited with {process.returncode}")
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ggml-rpc-server at {address} did not listen") from None
            time.sleep(0.1)


def rpc_bench(model: Path, servers: list[str], decode: int, repeats: int = 5, threads: int = 1) -> dict:
    """llama-bench batch-1 decode with every layer on the RPC servers (-ngl 99, an even layer
    split, the output layer on the last): llama.cpp's RPC mode. The llama-bench process itself
    (token embeddings, sampling) runs `threads` threads. Each repetition's tok/s, and their mean."""
    rows, rss = _run_json([str(tools() / "llama-bench"), "-m", str(model), "-rpc", ",".join(servers), "-ngl", "99",
                           "-ts", "/".join("1" for _ in servers), "-t", str(threads), "-p", "0", "-n", str(decode),
                           "-r", str(repeats), "-o", "json"])
    (row,) = [r for r in rows if r["n_gen"] and not r["n_prompt"]]
    return {"decode_tok_s": round(row["avg_ts"], 2), "decode_tok_s_runs": [round(x, 2) for x in row["samples_ts"]],
            "stddev_tok_s": round(row["stddev_ts"], 2), "backends": row.get("backends"),
            "client_peak_rss_mib": round(rss / 2**20, 1)}


def local_bench(model: Path, threads: int, decode: int, repeats: int = 5, core: int | None = None) -> dict:
    """llama-bench batch-1 decode in one process (the no-split reference), pinned to `core`."""
    pin = ["taskset", "-c", str(core)] if core is not None else []
    rows, _ = _run_json([*pin, str(tools() / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "0",
                         "-n", str(decode), "-r", str(repeats), "-o", "json"])
    (row,) = [r for r in rows if r["n_gen"] and not r["n_prompt"]]
    return {"decode_tok_s": round(row["avg_ts"], 2), "decode_tok_s_runs": [round(x, 2) for x in row["samples_ts"]]}


def peak_rss_mib(pid: int) -> float:
    """Peak resident memory of a running process (VmHWM): what an RPC server held of the model
    (it frees the buffers when the client disconnects, so the current RSS says little)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")
