"""ctypes binding of the C bf16 matrix-vector kernel (gemv.c), loaded only where it can run.

`load_gemv()` returns None, logging the reason at debug, when the library was not built or
the CPU lacks AVX-512 BF16; callers then keep torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import Tensor

from meshllm.engine.kernels.build import LIBRARY
from meshllm.engine.kernels.custom_ops import op_address

REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
CPUINFO = Path("/proc/cpuinfo")

log = logging.getLogger(__name__)


def cpu_flags() -> set[str]:
    try:
        text = CPUINFO.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@functools.cache
def load_gemv():
    """The C function gemv_bf16, or None when this machine cannot run it."""
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        log.debug("bf16 CPU kernel unused: CPU lacks %s", ", ".join(missing))
        return None
    if not LIBRARY.exists():
        log.debug("bf16 CPU kernel unused: %s not built (python -m meshllm.engine.kernels.build)", LIBRARY)
        return None
    try:
        library = ctypes.CDLL(str(LIBRARY))
    except OSError as error:
        log.debug("bf16 CPU kernel unused: loading %s failed: %s", LIBRARY, error)
        return None
    function = library.gemv_bf16
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return function


@functools.cache
def ggml_few_rows_op() -> int | None:
    """Address of the C ggml custom op meshllm_ggml_bf16_few_rows (gemv.c), or None where the
    kernel cannot run or was built without ggml's header."""
    if load_gemv() is None:
        return None
    return op_address(LIBRARY, "meshllm_ggml_bf16_few_rows", "meshllm_ggml_tensor_size")


def gemv_bf16(weight: Tensor, x: Tensor, bias: Tensor | None = None, threads: int | None = None) -> Tensor:
    """x [rows, K] @ weight[N, K].T (+ bias) with the C kernel; all bf16, contiguous, on CPU."""
    function = load_gemv()
    assert function is not None, "gemv_bf16 called without a loaded kernel; check load_gemv() first"
    rows, (out_features, in_features) = x.shape[0], weight.shape
    y = torch.empty(rows, out_features, dtype=torch.bfloat16)
    function(weight.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
             rows, out_features, in_features, torch.get_num_threads() if threads is None else threads)
    return y
