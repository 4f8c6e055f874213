"""meshllm's C functions that run as ggml custom ops: their addresses, checked against the loaded ggml.

A custom op reads ggml's `struct ggml_tensor` directly, so each library exports the struct size it
was compiled against; an op built against another ggml (ggml rebuilt, kernels not) is refused.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

from meshllm.engine.kernels.build import (ATTENTION_LIBRARY, K_QUANT_FEW_ROWS_LIBRARY, QUANT_FEW_ROWS_LIBRARY,
                                          REMAINDER_LIBRARY)

log = logging.getLogger(__name__)


def op_address(library_path: Path, op_name: str, size_name: str) -> int | None:
    """Address of `op_name` in the library, or None where it is missing or built for another ggml."""
    if not library_path.exists():
        log.debug("%s unused: %s not built (python -m meshllm.engine.kernels.build)", op_name, library_path)
        return None
    try:
        library = ctypes.CDLL(str(library_path))
    except OSError as error:
        log.debug("%s unused: loading %s failed: %s", op_name, library_path, error)
        return None
    op, size = (getattr(library, name, None) for name in (op_name, size_name))
    if op is None or size is None:
        return None
    import ggml  # the ggml ctypes binding the stage runs on

    size.restype = ctypes.c_size_t
    if size() != ctypes.sizeof(ggml.ggml_tensor):
        log.warning("%s unused: %s was built against another ggml (struct ggml_tensor of %d bytes, the "
                    "loaded ggml's is %d); rebuild it: python -m meshllm.engine.kernels.build",
                    op_name, library_path, size(), ctypes.sizeof(ggml.ggml_tensor))
        return None
    return ctypes.cast(op, ctypes.c_void_p).value


@functools.cache
def q4_remainder_op() -> int | None:
    """meshllm_ggml_q4_remainder (q4_remainder.c): dst = Q4_0 product + R^T blocksums(x)."""
    return op_address(REMAINDER_LIBRARY, "meshllm_ggml_q4_remainder", "meshllm_q4_remainder_tensor_size")


def _op_where_it_runs(library_path: Path, op_name: str, size_name: str, runs_name: str) -> int | None:
    """op_address, or None also where the library was built for a CPU that cannot run the op (its
    `runs_name` function answers 0: the kernels' instructions were left out)."""
    address = op_address(library_path, op_name, size_name)
    if address is None or not getattr(ctypes.CDLL(str(library_path)), runs_name)():
        return None
    return address


@functools.cache
def q4_few_rows_op() -> int | None:
    """meshllm_ggml_q4_0x8_few_rows (quant_few_rows.c): repacked Q4_0 (+ a Q4_1 remainder) times a
    few rows, or None where it was not built or this CPU lacks AVX-512 VNNI."""
    return _op_where_it_runs(QUANT_FEW_ROWS_LIBRARY, "meshllm_ggml_q4_0x8_few_rows",
                             "meshllm_quant_few_rows_tensor_size", "meshllm_quant_few_rows_available")


@functools.cache
def q8_few_rows_op() -> int | None:
    """meshllm_ggml_q8_0_few_rows (quant_few_rows.c): plain Q8_0 times a few rows, or None."""
    return _op_where_it_runs(QUANT_FEW_ROWS_LIBRARY, "meshllm_ggml_q8_0_few_rows",
                             "meshllm_quant_few_rows_tensor_size", "meshllm_quant_few_rows_available")


def _k_quant_op(name: str) -> int | None:
    return _op_where_it_runs(K_QUANT_FEW_ROWS_LIBRARY, name, "meshllm_k_quant_few_rows_tensor_size",
                             "meshllm_k_quant_few_rows_available")


@functools.cache
def k_quant_few_rows_op() -> int | None:
    """meshllm_ggml_k_quant_few_rows (k_quant_few_rows.c): plain Q4_K, Q5_K or Q6_K times a few
    rows, or None where it was not built or this CPU lacks AVX-512 VNNI."""
    return _k_quant_op("meshllm_ggml_k_quant_few_rows")


@functools.cache
def q4_kx8_few_rows_op() -> int | None:
    """meshllm_ggml_q4_kx8_few_rows (k_quant_few_rows.c): Q4_K in ggml's repack buffer times a few
    rows, or None where it was not built or this CPU lacks AVX-512 VNNI."""
    return _k_quant_op("meshllm_ggml_q4_kx8_few_rows")


@functools.cache
def q8_0x8_ops() -> tuple[int, int] | None:
    """(meshllm_ggml_q8_0x8_rows, meshllm_ggml_q8_0x8_get_rows) (quant_few_rows.c): a Q8_0 matrix in
    meshllm's 8-row layout (ggml_weights.repack_q8_0x8) times any number of rows, and its rows
    dequantized by id; or None where they were not built or this CPU lacks AVX-512 VNNI."""
    ops = tuple(_op_where_it_runs(QUANT_FEW_ROWS_LIBRARY, name, "meshllm_quant_few_rows_tensor_size",
                                  "meshllm_quant_few_rows_available")
                for name in ("meshllm_ggml_q8_0x8_rows", "meshllm_ggml_q8_0x8_get_rows"))
    return None if None in ops else ops


def _attention_op(name: str) -> int | None:
    return _op_where_it_runs(ATTENTION_LIBRARY, name, "meshllm_attention_tensor_size", "meshllm_attention_available")


@functools.cache
def attention_op() -> int | None:
    """meshllm_ggml_attention_few_rows (few_rows_attention.c): causal attention of a few query rows
    of one sequence over a bf16 KV cache, or None where it was not built or this CPU lacks AVX-512."""
    return _attention_op("meshllm_ggml_attention_few_rows")


@functools.cache
def batched_attention_ops() -> tuple[int, int] | None:
    """(meshllm_ggml_kv_write_batch, meshllm_ggml_attention_batch) (few_rows_attention.c): KV writes
    and attention of every sequence of a step from a table patched per step, or None."""
    ops = (_attention_op("meshllm_ggml_kv_write_batch"), _attention_op("meshllm_ggml_attention_batch"))
    return None if None in ops else ops
