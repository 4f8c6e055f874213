"""Start-up probe: quick, positive, cached per machine and device."""

import json
import time

import pytest

from meshllm.cluster import profile


def test_probe_is_quick_and_positive():
    started = time.perf_counter()
    measured = profile.probe("cpu")
    assert time.perf_counter() - started < 2.0 * 2  # < 2 s; doubled for a busy shared CI core
    assert measured.device == "cpu" and measured.memory_bandwidth_gbps > 0.1 and measured.matmul_gflops > 0.1


def test_probe_result_is_cached(tmp_path, monkeypatch):
    first = profile.load_or_probe("cpu", tmp_path)
    monkeypatch.setattr(profile, "probe", lambda device: pytest.fail("probed again despite the cache"))
    assert profile.load_or_probe("cpu", tmp_path) == first
    assert list(json.loads((tmp_path / profile.PROFILE_FILE).read_text()).values())[0]["device"] == "cpu"


def test_unreadable_cache_is_replaced(tmp_path, monkeypatch):
    (tmp_path / profile.PROFILE_FILE).write_text("{not json")
    fake = profile.DeviceProfile("cpu", 1.0, 2.0)
    monkeypatch.setattr(profile, "probe", lambda device: fake)
    assert profile.load_or_probe("cpu", tmp_path) == fake
    assert profile.load_or_probe("cpu", tmp_path) == fake  # and it was written back


def test_memory_of_cpu():
    total, free = profile.memory_of("cpu")
    assert total >= free > 0
    assert profile.platform_name().count("-") >= 1
