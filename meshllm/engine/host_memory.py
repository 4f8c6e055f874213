"""Keep freed host memory from staying resident (glibc's malloc; a no-op elsewhere).

glibc serves large allocations with mmap and returns them to the OS on free, but raises that
threshold to the size of each such block freed (up to 32 MiB): after the first large free (a KV
cache, a prefill's activations, a weight read buffer) every later block of that size comes from
the heap, and the heap only shrinks from its top, so freed KV caches and prefill buffers stay
resident. Measured (bench/decode.py's workload, 1.1B Q8_0, 2 threads, AMD Zen 4): RSS after
decoding and a 512-token prefill 1546 MiB with glibc's default, 1491 with a fixed 1 MiB threshold;
no decode or prefill figure moved beyond noise (a step allocates nothing that large: the graphs'
buffers are kept).
"""

from __future__ import annotations

import ctypes
import functools

_M_MMAP_THRESHOLD = -3  # malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def _libc():
    """The process's own C library symbols (no ctypes.util.find_library: it runs ldconfig, ~4 ms)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def return_large_frees() -> bool:
    """Fix glibc's mmap threshold (which also stops its growth), so blocks of at least
    MMAP_THRESHOLD_BYTES go back to the OS when freed. Call once, early; True when it took."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1)


def return_freed_memory() -> None:
    """Give freed heap pages back to the OS now (after loading: the weight read buffers)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
