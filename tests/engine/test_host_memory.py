"""engine/host_memory.py: freed KV caches and prefill buffers leave the process's RSS.

Each case runs in a fresh interpreter (the setting is process-wide). The unset case is the
control: it shows glibc's default keeps such blocks resident, so the fixed case's drop is the
setting's doing.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

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
