"""ggml (the kernel library under llama.cpp) through ggml-python's ctypes layer, loaded only where it runs.

meshllm drives ggml's CPU backend directly: weights live in ggml backend buffers (the CPU
"repack" buffer type for the types ggml re-lays out for its AVX2/AVX-512 kernels), and
activations and KV caches stay torch tensors whose memory ggml tensors point at, so there is
no copy at the boundary. `runtime()` returns None (reason logged at debug) when the package is
missing, its version is not the pinned one, or its struct layout disagrees with the library;
callers then keep torch's path.

Two traps this module exists to avoid: the ctypes declarations must match the compiled ggml
exactly (so the version is pinned and the layout checked at load), and a bad shape inside ggml
aborts the whole process through GGML_ASSERT (so callers validate shapes before building a graph).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass

import torch
from gguf.constants import GGMLQuantizationType as GGML

log = logging.getLogger(__name__)

# Pinned, both: ggml-python's ctypes layer, built (install.sh) over the newer ggml that llama.cpp
# vendors in this llama-cpp-python sdist. ggml-python's own vendored ggml (0.15.3) lacks the tiled
# K-quant GEMM that llama.cpp's has: measured (AMD Zen 4, 2 threads, 5632x2048 times 512 rows)
# Q5_K 80 -> 501 GFLOPS, Q6_K 124 -> 389, Q4_K 148 -> 287; one-row products unchanged or faster.
# Between the two no function meshllm calls changed its C signature, and the structs it passes did
# not change (headers compared; tests/engine/test_ggml_weights.py checks the return types the
# ctypes layer declares for the pointer-returning ones; the tensor struct is checked at load).
GGML_PYTHON_VERSION = "0.0.45"
GGML_SOURCE = "llama-cpp-python==0.3.36"
GGML_VERSION = "0.25.3"
# Experts matrices ggml re-lays out (Runtime.experts_buffer_type_for; MXFP4's kernels need AVX2).
# Its repacked expert product multiplies row by row: for MXFP4 faster in decode and prefill alike
# (a gpt-oss-shaped model, 2 threads, AMD Zen 4: decode 0.83x -> 1.11x llama.cpp, prefill 0.79x
# -> 1.05x); for Q4_K faster in decode but not in prefill, where the plain layout's product takes
# many rows at once (a Qwen3-MoE shape: decode 0.95x -> 1.08x, prefill 1.7x -> 1.1x), so Q4_K
# experts (and the unmeasured types) stay plain.
REPACKED_EXPERT_TYPES = frozenset((GGML.MXFP4,))
# Context metadata: one graph of a whole stage has a few thousand nodes.
MAX_GRAPH_NODES = 16384


@dataclass(frozen=True)
class Runtime:
    """The loaded library, the CPU backend's buffer types and one thread pool."""

    lib: object  # the ggml module of ggml-python
    cpu_buffer_type: int
    repack_buffer_type: int | None  # None where this CPU has no repacked kernels
    threadpool: int
    num_threads: int

    def buffer_type_for(self, ggml_type: int, rows: int) -> int:
        """Repack buffer for the types whose fast CPU kernels need their layout, else plain CPU.

        Mirrors ggml_repack_get_optimal_repack_type (ggml-cpu/repack.cpp) for x86: a tensor put in
        the repack buffer that ggml has no repacked kernel for crashes at upload, so only these go.
        """
        if self.repack_buffer_type is not None and ggml_type in self.repacked_types and rows % 8 == 0:
            return self.repack_buffer_type
        return self.cpu_buffer_type

    def experts_buffer_type_for(self, ggml_type: int, rows: int) -> int:
        """The repack buffer for an experts matrix (`rows` per expert) of a type whose repacked
        expert product is measured faster (REPACKED_EXPERT_TYPES), else plain CPU. Only expert
        products read them: ggml's repacked kernels for a plain product of a few rows differ by
        row count, and meshllm has few-row ops for none of these types."""
        if self.repack_buffer_type is not None and ggml_type in REPACKED_EXPERT_TYPES and rows % 8 == 0 \
                and self.lib.ggml_cpu_has_avx2():
            return self.repack_buffer_type
        return self.cpu_buffer_type

    def repacks(self, ggml_type: int, rows: int) -> bool:
        """Whether a matrix of this type and row count goes to the repack buffer (fast kernels)."""
        return self.buffer_type_for(int(ggml_type), rows) != self.cpu_buffer_type

    @property
    def repacked_types(self) -> frozenset[int]:
        g = self.lib
        types = {g.GGML_TYPE_Q4_0, g.GGML_TYPE_Q4_K, g.GGML_TYPE_IQ4_NL}
        if g.ggml_cpu_has_avx512():
            types.add(g.GGML_TYPE_Q2_K)
        return frozenset(types)


def _extra_buffer_types(g, device) -> list[int]:
    """ggml_backend_dev_get_extra_bufts of the CPU backend, reached through the registry."""
    reg = g.ggml_backend_dev_backend_reg(device)
    address = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return []
    fn = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)
    array = fn(device)
    out = []
    i = 0
    while array and array[i]:
        out.append(array[i])
        i += 1
    return out


def _layout_matches(g) -> str | None:
    """None when ggml-python's struct layout agrees with the compiled library, else why not."""
    version = g.ggml_version().decode()
    if version != GGML_VERSION:
        return f"ggml {version} is not the pinned {GGML_VERSION}"
    # ggml_tensor_overhead() is sizeof(ggml_object) + sizeof(ggml_tensor) as compiled.
    compiled_tensor = g.ggml_tensor_overhead() - g.GGML_OBJECT_SIZE
    if compiled_tensor != ctypes.sizeof(g.ggml_tensor):
        return f"ggml_tensor is {compiled_tensor} bytes in the library, {ctypes.sizeof(g.ggml_tensor)} in ctypes"
    return None


# ggml's levels (ggml_log_level) as Python logging's: its debug and info lines (one per repacked
# tensor at load, hundreds a model) are debug here; warnings and errors stay what they are.
_LOG_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_ggml_log = logging.getLogger("ggml")


def _route_logs(g) -> None:
    """Send ggml's log lines to Python logging (by default ggml writes every level to stderr)."""
    last = [logging.DEBUG]  # GGML_LOG_LEVEL_CONT (5) continues the previous line's level

    def forward(level: int, text: bytes, _user_data) -> None:
        last[0] = _LOG_LEVELS.get(level, last[0])
        message = (text or b"").decode("utf-8", "replace").rstrip()
        if message:
            _ggml_log.log(last[0], "%s", message)

    callback = g.ggml_log_callback(forward)
    _route_logs.callback = callback  # ggml keeps only the C pointer: the ctypes object must stay alive
    g.ggml_log_set(callback, None)


@functools.cache
def _compute_threads() -> int:
    """torch's thread count before the first pool took the cores (runtime() leaves torch one)."""
    return torch.get_num_threads()


@functools.cache
def runtime(num_threads: int | None = None) -> Runtime | None:
    """The ggml runtime with `num_threads` compute threads (torch's count by default), or None."""
    if os.environ.get("MESHLLM_NO_GGML"):
        log.debug("ggml unused: MESHLLM_NO_GGML is set")
        return None
    try:
        from importlib.metadata import version

        installed = version("ggml-python")
        if installed != GGML_PYTHON_VERSION:
            log.debug("ggml unused: ggml-python %s installed, meshllm pins %s", installed, GGML_PYTHON_VERSION)
            return None
        import ggml as g
    except (ImportError, OSError) as error:  # not installed, or the library failed to load
        log.debug("ggml unused: %s", error)
        return None
    problem = _layout_matches(g)
    if problem:
        log.debug("ggml unused: %s", problem)
        return None
    if not g.ggml_cpu_has_avx2():
        log.debug("ggml unused: this CPU lacks AVX2, ggml's CPU kernels would be no faster than torch's")
        return None
    _route_logs(g)
    g.ggml_cpu_init()
    if not g.ggml_cpu_has_llamafile():
        log.info("ggml was built without llamafile's GEMM kernels (GGML_LLAMAFILE): prefill and batched decode "
                 "run slower; ./install.sh rebuilds it")
    device = g.ggml_backend_dev_by_type(g.GGML_BACKEND_DEVICE_TYPE_CPU)
    extra = _extra_buffer_types(g, device)
    repack = next((b for b in extra if g.ggml_backend_buft_name(b) == b"CPU_REPACK"), None)
    default = _compute_threads()  # read before any pool leaves torch one thread, whichever comes first
    threads = num_threads or default
    params = g.ggml_threadpool_params_default(threads)
    # Workers sleep as soon as a graph is done, instead of spinning up to ~100 ms for the next
    # one (poll 50, ggml's default): a step's graph wakes them for the price of one futex call.
    # Measured (SmolLM2 Q4_1, 2 threads, alternating): decode through the leader 188-203 tok/s
    # with 0 against 155-211 with 50, the same within noise; but the spinning took a core from
    # every other thread and process, the test suite's node processes among them.
    params.poll = 0
    pool = g.ggml_threadpool_new(ctypes.byref(params))
    # The cores are the pool's now: torch's few ops around ggml's (sampling, copies) run on one
    # thread. With more, torch's OpenMP workers spin after each of its ops on the core a pool
    # thread needs: SmolLM2 Q4_1 decode at batch 8, 2 threads, fell to 260-340 tok/s from 530-670.
    # (torch's own fallback path lost nothing by it: through the leader it ran 28-32 tok/s on one
    # thread, 23-26 on two.)
    torch.set_num_threads(1)
    # Not ggml_backend_cpu_buffer_type(): ggml-python 0.0.45 declares it returning a C int, which
    # truncates the pointer (tests/engine/test_ggml_weights.py checks those meshllm calls return pointers).
    return Runtime(g, g.ggml_backend_dev_buffer_type(device), repack, pool, threads)
