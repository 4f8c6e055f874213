"""Keep freed host memory from staying resident (glibc's malloc; a no-op elsewhere), and keep
weights in 2 MiB pages (Linux).

glibc serves large allocations with mmap and returns them to the OS on free, but raises that
threshold to the size of each such block freed (up to 32 MiB): after the first large free (a KV
cache, a prefill's activations, a weight read buffer) every later block of that size comes from
the heap, and the heap only shrinks from its top, so freed KV caches and prefill buffers stay
resident. Measured (bench/decode.py's workload, 1.1B Q8_0, 2 threads, AMD Zen 4): RSS after
decoding and a 512-token prefill 1546 MiB with glibc's default, 1491 with a fixed 1 MiB threshold;
no decode or prefill figure moved beyond noise (a step allocates nothing that large: the graphs'
buffers are kept).

Weights are read start to end every decode step, at memory speed. In 4 KiB pages that stream
misses the TLB every page and the CPU's hardware prefetchers stop at each page's end; in 2 MiB
pages neither happens. Measured on the 2-vCPU Zen 4 VM: one thread summing a 768 MiB buffer,
8 alternating rounds, 24.2 GB/s in 4 KiB pages against 28.0 in 2 MiB ones. Transparent huge
pages only back what is madvised on most distributions ("madvise" mode), and weights are
allocated matrix by matrix (ggml's buffers, torch's tensors). So a ggml matrix's buffer is hinted
(MADV_HUGEPAGE) before its upload writes it, and after loading a stage asks the kernel to collapse
its weights' spans into huge pages (MADV_COLLAPSE, Linux 6.1+: what small pages remain, such as
the 2 MiB straddling two buffers, or torch's tensors, are copied into huge ones; older kernels
keep the hint, which khugepaged acts on slowly).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from collections.abc import Iterable
from pathlib import Path

_M_MMAP_THRESHOLD = -3  # malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # asm-generic/mman-common.h
HUGE_PAGE_BYTES = 2 << 20
# Spans closer than this are collapsed as one, with what lies between: consecutive big matrices
# are a few KiB apart (headers, padding), small ones sit in malloc's heap among other blocks.
# SmolLM2 Q4_1: 46 of its 98 MiB of weights in huge pages when joining only gaps under 64 KiB,
# all of them joining gaps under 2 MiB, for 7 MiB more resident (pages between never touched).
_JOIN_GAP_BYTES = HUGE_PAGE_BYTES
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _libc():
    """The process's own C library symbols (no ctypes.util.find_library: it runs ldconfig, ~4 ms)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    if hasattr(libc, "madvise"):
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def return_large_frees() -> bool:
    """Fix glibc's mmap threshold (which also stops its growth), so blocks of at least
    MMAP_THRESHOLD_BYTES go back to the OS when freed. Call once, early; True when it took."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "mallopt")
                and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1)


def return_freed_memory() -> None:
    """Give freed heap pages back to the OS now (after loading: the weight read buffers)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _madvise():
    """libc's madvise where huge pages may be asked for: Linux on x86-64 or arm64 (the advice
    numbers above are theirs) with transparent huge pages not switched off (by the admin, or
    MESHLLM_HUGE_PAGES=0); else None."""
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise") or not _huge_pages_allowed():
        return None
    return libc.madvise


def _huge_pages_allowed() -> bool:
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64") \
            or os.environ.get("MESHLLM_HUGE_PAGES") == "0":
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def _joined(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, end) address spans, sorted, those at most _JOIN_GAP_BYTES apart made one."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start - out[-1][1] <= _JOIN_GAP_BYTES:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _vmas() -> list[tuple[int, int]]:
    """This process's mappings, (start, end)."""
    with open("/proc/self/maps") as maps:
        return [tuple(int(x, 16) for x in line.split(maxsplit=1)[0].split("-")) for line in maps]


def _interior(start: int, end: int) -> tuple[int, int]:
    """The whole 2 MiB pages inside [start, end): (first address, bytes), bytes <= 0 if none."""
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    return first, end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES - first


@functools.cache
def _collapse_known() -> bool:
    """Whether this kernel knows MADV_COLLAPSE (Linux 6.1+): advice it does not know is refused
    with EINVAL even over zero bytes, before anything else is looked at."""
    libc = _libc()
    return (sys.platform.startswith("linux") and libc is not None and hasattr(libc, "madvise")
            and libc.madvise(0, 0, _MADV_COLLAPSE) == 0)


def hint_huge_pages(start: int, end: int) -> None:
    """Ask for 2 MiB pages in [start, end) before it is first written: they then come huge at the
    first touch, with nothing for back_with_huge_pages to copy afterwards."""
    madvise = _madvise()
    first, size = _interior(start, end)
    if madvise is not None and size > 0:
        madvise(first, size, _MADV_HUGEPAGE)


def back_with_huge_pages(spans: Iterable[tuple[int, int]]) -> int:
    """Back the whole 2 MiB pages inside these (start, end) spans of this process's memory with
    huge pages now; returns the bytes collapsed (0 where this cannot be done: not Linux, THP
    off, a kernel before 6.1, which keeps the MADV_HUGEPAGE hint for khugepaged). The contents
    stay."""
    madvise = _madvise()
    if madvise is None:
        return 0
    collapse = _collapse_known()
    collapsed, vmas = 0, None
    for start, end in _joined(spans):
        first, size = _interior(start, end)
        if size <= 0:
            continue
        # The hint first: a span covers several mappings (one per allocation, some already
        # hinted by their allocator), and the same flags let the kernel merge them.
        madvise(first, size, _MADV_HUGEPAGE)
        if not collapse:
            continue  # khugepaged may act on the hint
        if madvise(first, size, _MADV_COLLAPSE) == 0:
            collapsed += size
            continue
        # The kernel stops at the first mapping that fails (EINVAL: one that cannot hold a whole
        # huge page; EAGAIN: no huge page free; ENOMEM: a hole in the span), so the ones after
        # it go one at a time.
        vmas = _vmas() if vmas is None else vmas
        for vma_start, vma_end in vmas:
            piece, piece_size = _interior(max(vma_start, first), min(vma_end, first + size))
            if piece_size > 0 and madvise(piece, piece_size, _MADV_COLLAPSE) == 0:
                collapsed += piece_size
    return collapsed
