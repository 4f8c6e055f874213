"""engine/host_memory.py: freed KV caches and prefill buffers leave the process's RSS, and
weights are collapsed into 2 MiB pages.

Each case runs in a fresh interpreter (the setting is process-wide). The unset case is the
control: it shows glibc's default keeps such blocks resident, so the fixed case's drop is the
setting's doing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from meshllm.engine import host_memory
from meshllm.engine.host_memory import return_large_frees

# A 16 MiB tensor freed (glibc then serves blocks up to 16 MiB from its heap), then 32 MiB in
# 4 MiB tensors (a sequence's KV cache, a prefill's activations) under a small live block that
# pins the heap's top, then those freed: prints the MiB still resident.
_WORKLOAD = """
import sys, psutil, torch
from meshllm.engine.host_memory import return_large_frees
if sys.argv[1] == "fixed":
    assert return_large_frees()
rss = lambda: psutil.Process().memory_info().rss
big = torch.ones(16 << 20, dtype=torch.uint8)
del big
before = rss()
blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(8)]
pin = torch.ones(64 << 10, dtype=torch.uint8)
del blocks
print((rss() - before) / 2**20)
"""


def _resident_after_frees(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", _WORKLOAD, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.split()[-1])


def test_freed_blocks_leave_the_resident_set():
    if not return_large_frees():
        pytest.skip("not glibc: nothing to set")
    kept_by_default, kept_fixed = _resident_after_frees("default"), _resident_after_frees("fixed")
    assert kept_fixed < 4, f"{kept_fixed:.1f} MiB of freed blocks still resident"
    assert kept_by_default > kept_fixed + 16, "glibc's default no longer keeps them: the setting may be moot"


# --- weights in 2 MiB pages ---------------------------------------------------------------------

_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # like malloc's; the default, shared, is shmem


def _collapse_supported() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not switched off."""
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return "[never]" not in setting and (major, minor) >= (6, 1)


def _huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of the mappings overlapping [start, end), from /proc/self/smaps, each
    mapping's counted up to its overlap with the range."""
    total, overlap = 0, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            overlap = max(0, min(hi, end) - max(lo, start))
        elif overlap and head == "AnonHugePages:":
            total += min(int(line.split()[1]) * 1024, overlap)
    return total


def test_spans_apart_by_less_than_a_huge_page_are_joined():
    mib = 1 << 20
    spans = [(10 * mib, 11 * mib), (0, mib), (mib + 4096, 3 * mib), (5 * mib + 1, 6 * mib), (2 * mib, 2 * mib + 1)]
    assert host_memory._joined(spans) == [(0, 3 * mib), (5 * mib + 1, 6 * mib), (10 * mib, 11 * mib)]
    assert host_memory._interior(3 * mib, 9 * mib) == (4 * mib, 4 * mib)
    assert host_memory._interior(mib, 3 * mib)[1] <= 0


@pytest.mark.skipif(not _collapse_supported(), reason="needs Linux 6.1+ (MADV_COLLAPSE) with THP not 'never'")
def test_a_filled_buffer_is_collapsed_into_huge_pages_and_keeps_its_bytes(monkeypatch):
    monkeypatch.delenv("MESHLLM_HUGE_PAGES", raising=False)
    size = 16 << 20
    buffer = mmap.mmap(-1, size, flags=_PRIVATE)  # fresh anonymous memory: small pages under THP's "madvise" mode
    pattern = bytes(range(251)) * (size // 251) + bytes(size % 251)
    buffer.write(pattern)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    collapsed = host_memory.back_with_huge_pages([(start, start + size)])
    assert collapsed >= size - 2 * host_memory.HUGE_PAGE_BYTES
    assert _huge_bytes(start, start + size) >= collapsed
    assert buffer[:] == pattern


@pytest.mark.skipif(not _collapse_supported(), reason="needs Linux 6.1+ with THP not 'never'")
def test_memory_hinted_before_its_first_write_comes_in_huge_pages(monkeypatch):
    monkeypatch.delenv("MESHLLM_HUGE_PAGES", raising=False)
    size = 16 << 20
    buffer = mmap.mmap(-1, size, flags=_PRIVATE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    host_memory.hint_huge_pages(start, start + size)
    buffer.write(b"\7" * size)
    assert _huge_bytes(start, start + size) >= size - 2 * host_memory.HUGE_PAGE_BYTES


def test_huge_pages_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("MESHLLM_HUGE_PAGES", "0")
    buffer = mmap.mmap(-1, 8 << 20, flags=_PRIVATE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    host_memory.hint_huge_pages(start, start + (8 << 20))
    buffer.write(b"\1" * (8 << 20))
    assert host_memory.back_with_huge_pages([(start, start + (8 << 20))]) == 0
    assert _huge_bytes(start, start + (8 << 20)) == 0 or "[always]" in Path(
        "/sys/kernel/mm/transparent_hugepage/enabled").read_text()


# Loads a GGUF as a stage does and prints the share of its weight bytes that the mappings holding
# them have in huge pages. In a fresh interpreter: in this one, memory that earlier tests hinted
# or collapsed is reused, and a mapping's huge pages say nothing about this load.
_STAGE_WORKLOAD = """
import sys
from meshllm.engine import host_memory
from meshllm.engine.quantized import ggml_matrices
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.source import open_model
from tests.engine.test_host_memory import _huge_bytes
host_memory.return_large_frees()
files = open_model(sys.argv[1])
decoder = load_stage_decoder(files.source, files.config)
matrices = ggml_matrices(decoder)
spans = host_memory._joined(span for m in matrices for span in m.spans())
print(sum(_huge_bytes(start, end) for start, end in spans) / sum(m.num_bytes for m in matrices))
"""


@pytest.mark.skipif(not _collapse_supported(), reason="needs Linux 6.1+ (MADV_COLLAPSE) with THP not 'never'")
def test_a_loaded_stage_holds_its_weights_in_huge_pages(smollm2_gguf_path):
    """The SmolLM2 Q4_1 GGUF, every layer, loaded with huge pages switched off (the control:
    small pages, whatever the allocators hinted) and on."""
    from meshllm.engine.ggml_lib import runtime

    if runtime() is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    if "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        pytest.skip("THP 'always': memory comes huge without being asked, so there is no control")

    def huge_share(switch: str) -> float:
        env = {**os.environ, "MESHLLM_HUGE_PAGES": switch}
        done = subprocess.run([sys.executable, "-c", _STAGE_WORKLOAD, str(smollm2_gguf_path)], capture_output=True,
                              text=True, timeout=120, env=env, cwd=Path(__file__).resolve().parents[2])
        assert done.returncode == 0, done.stderr
        return float(done.stdout.split()[-1])

    off, on = huge_share("0"), huge_share("1")
    assert on >= 0.9, f"{on:.0%} of the weights in huge pages"
    assert off < 0.6, f"{off:.0%} in huge pages without the collapse: the check is moot here"
