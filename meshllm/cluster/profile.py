"""What this machine can do: memory and a short start-up speed probe.

The probe (memory copy bandwidth and a float32 matmul) takes well under two
seconds and is cached per machine and device in <state-dir>/profile.json, so
later starts skip it. Numbers are for ranking nodes against each other, not
for benchmarks.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import psutil

log = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
_COPY_BYTES = 64 * 1024 * 1024
_MATMUL_N = 512
_REPEATS = 5


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    device: str
    memory_bandwidth_gbps: float  # GB/s, read + write of a large copy
    matmul_gflops: float  # float32 n x n matmul


def platform_name() -> str:
    return f"{platform.system().lower()}-{platform.machine().lower()}"


def memory_of(device: str) -> tuple[int, int]:
    """(total, free) bytes of the memory the device computes from."""
    if device.startswith("cuda"):
        import torch  # only nodes with a GPU pay for the import here

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(total), int(free)
    # cpu, and mps whose unified memory is system memory
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def _best_seconds(run, sync=lambda: None) -> float:
    run()  # warm-up: page faults, kernel selection
    sync()
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _probe_numpy(device: str) -> DeviceProfile:
    src = np.ones(_COPY_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    copy_s = _best_seconds(lambda: np.copyto(dst, src))
    a = np.random.default_rng(0).standard_normal((_MATMUL_N, _MATMUL_N), dtype=np.float32)
    matmul_s = _best_seconds(lambda: a @ a)
    return DeviceProfile(device, 2 * _COPY_BYTES / copy_s / 1e9, 2 * _MATMUL_N**3 / matmul_s / 1e9)


def _probe_torch(device: str) -> DeviceProfile:
    import torch

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else torch.mps.synchronize
    src = torch.ones(_COPY_BYTES // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), sync)
    a = torch.randn(_MATMUL_N * 4, _MATMUL_N * 4, device=dev)  # GPUs need a bigger problem to fill
    matmul_s = _best_seconds(lambda: a @ a, sync)
    return DeviceProfile(device, 2 * _COPY_BYTES / copy_s / 1e9, 2 * (_MATMUL_N * 4) ** 3 / matmul_s / 1e9)


def probe(device: str) -> DeviceProfile:
    """Measure now (about half a second on a CPU)."""
    return _probe_numpy(device) if device == "cpu" else _probe_torch(device)


def _cache_key(device: str) -> str:
    # A different machine or memory size (a cloned state dir, an upgrade) re-probes.
    return f"{socket.gethostname()}|{platform_name()}|{os.cpu_count()}|{psutil.virtual_memory().total}|{device}"


def load_or_probe(device: str, state_dir: Path) -> DeviceProfile:
    """The cached profile for this machine and device, probing on a miss."""
    path = state_dir / PROFILE_FILE
    key = _cache_key(device)
    try:
        cached = json.loads(path.read_text())
    except FileNotFoundError:
        cached = {}
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable profile cache %s: %s", path, e)
        cached = {}
    entry = cached.get(key) if isinstance(cached, dict) else None
    if isinstance(entry, dict):
        try:
            return DeviceProfile(**entry)
        except TypeError:
            log.warning("ignoring stale profile cache entry in %s", path)
    profile = probe(device)
    log.info("probed %s: %.1f GB/s memory, %.1f GFLOP/s matmul", device, profile.memory_bandwidth_gbps,
             profile.matmul_gflops)
    cached = cached if isinstance(cached, dict) else {}
    cached[key] = asdict(profile)
    state_dir.mkdir(parents=True, exist_ok=True)
    # Write-then-rename: nodes sharing a state dir may probe at the same time.
    tmp = path.with_name(f"{PROFILE_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cached, indent=1))
    os.replace(tmp, path)
    return profile
