"""A rank process dying: the whole group fails at once (closed sockets), on every rank. The
timeout on a hung rank 0, heartbeats and clean teardown are tested with threads in
test_group_threads.py; a node killed mid-generation in test_tp_pipeline.py."""

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
def model_dir(tiny_model_dir) -> str:
    # Random weights whose 6 heads, 3 KV heads and 96 MLP rows split 3 ways (aidreams' 4 heads do not).
    return str(tiny_model_dir("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                              intermediate_size=96))


def test_a_killed_rank_fails_the_whole_group_at_once(model_dir):
    # Three ranks: killing rank 2 fails rank 0's next collective; rank 0 then closes its side,
    # and rank 1 sees its sockets to rank 0 close and leaves at once, as it would if rank 0 died.
    with RankProcesses(3, lifecycle_rank, (model_dir, "steps", TIMEOUT_S)) as ranks:
        ranks.expect(0, "ready", 120)
        ranks.expect(1, "ready", 120)
        victim = ranks.expect(2, "ready", 120)
        time.sleep(0.5)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        result = ranks.expect(0, "ok", TIMEOUT_S + MARGIN_S)
        exited_at, reason = ranks.expect(1, "exited", TIMEOUT_S + MARGIN_S)
        survivor = ranks.expect(1, "ok", 30)
    assert result["failed_at"] - killed_at < TIMEOUT_S + MARGIN_S
    assert "whole group has failed" in result["error"]
    assert len(result["on_failed"]) == 1  # the node drops the stage once
    assert result["again"].startswith("TensorParallelFailed after 0.0")  # later calls fail at once
    assert len(result["tokens"]) > 3
    # Rank 1 learns from closed sockets, not from its timeout.
    assert "rank 0 is gone" in reason and exited_at - result["failed_at"] < TIMEOUT_S
    assert not [t for t in survivor["threads"] if t.startswith("tp-worker")]
