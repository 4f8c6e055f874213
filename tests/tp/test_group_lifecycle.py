"""Rank processes dying: a killed rank 0 ends its worker at once (its sockets close), a killed
worker fails rank 0's whole group. Timeouts, heartbeats and clean teardown are tested with
threads in test_group_threads.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.tp.lifecycle_ranks import lifecycle_rank
from tests.tp.ranks import RankProcesses

TIMEOUT_S = 3.0  # the group's timeout: a rank silent this long has failed
MARGIN_S = 6.0  # a loaded 2-core machine may be slow to schedule the exiting thread


@pytest.fixture
def model_dir(aidreams_path) -> str:
    return str(aidreams_path)


def test_worker_exits_at_once_when_rank0_is_killed(model_dir):
    with RankProcesses(2, lifecycle_rank, (model_dir, "idle", TIMEOUT_S)) as ranks:
        rank0_pid = ranks.expect(0, "ready", 120)
        ranks.expect(1, "ready", 120)
        killed_at = time.time()
        os.kill(rank0_pid, signal.SIGKILL)
        exited_at, reason = ranks.expect(1, "exited", TIMEOUT_S + MARGIN_S)
        assert "rank 0 is gone" in reason
        # Its sockets closed, so the worker knows at once rather than after its timeout.
        assert exited_at - killed_at < TIMEOUT_S
        result = ranks.expect(1, "ok", 30)
        assert not [t for t in result["threads"] if t.startswith("tp-worker")]


def test_a_dead_worker_fails_rank0_group_once_and_for_all(model_dir):
    with RankProcesses(2, lifecycle_rank, (model_dir, "steps", TIMEOUT_S)) as ranks:
        ranks.expect(0, "ready", 120)
        worker_pid = ranks.expect(1, "ready", 120)
        time.sleep(0.5)
        killed_at = time.time()
        os.kill(worker_pid, signal.SIGKILL)
        result = ranks.expect(0, "ok", TIMEOUT_S + MARGIN_S)
    assert result["failed_at"] - killed_at < TIMEOUT_S + MARGIN_S
    assert "whole group has failed" in result["error"]
    assert len(result["on_failed"]) == 1  # the node drops the stage once
    assert result["again"].startswith("TensorParallelFailed after 0.0")  # later calls fail at once
    assert len(result["tokens"]) > 3
