"""The stall deadline and the blame rules: pure bookkeeping with a fake clock."""

from __future__ import annotations

import pytest

from meshllm.engine.step import StepResult
from meshllm.pipeline.deadline import DeadlineConfig, StallWatch
from meshllm.pipeline.failover import blame


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_fresh_leader_gives_the_cap_then_the_floor_for_decode_steps():
    clock = Clock()
    watch = StallWatch(DeadlineConfig(floor_s=1.0, cap_s=30.0, multiplier=4.0), clock)
    watch.sent(1)
    assert watch.seconds_left() == pytest.approx(30.0)  # nothing measured yet
    clock.now += 0.02
    watch.done(1, 0.02)
    watch.sent(1)
    assert watch.seconds_left() == pytest.approx(1.0)  # 4 x 20 ms is under the floor
    clock.now += 1.01
    assert watch.due()


def test_a_long_prefill_chunk_gets_what_such_chunks_were_measured_to_need():
    clock = Clock()
    watch = StallWatch(DeadlineConfig(floor_s=1.0, cap_s=60.0, multiplier=4.0), clock)
    for n, seconds in ((1, 0.05), (1, 0.05), (512, 2.61), (512, 2.61)):
        watch.sent(n)
        clock.now += seconds
        watch.done(n, seconds)
    watch.sent(512)
    assert watch.allowed_s(512) == pytest.approx(4 * (0.05 + 512 * 0.005), rel=0.01)  # ~10.4 s, not the floor
    clock.now += 5.0
    assert not watch.due()  # a legitimately long chunk is not a stall
    clock.now += 6.0
    assert watch.due()


def test_probes_that_find_everyone_alive_rearm_until_the_cap():
    clock = Clock()
    watch = StallWatch(DeadlineConfig(floor_s=1.0, cap_s=5.0), clock)
    watch.sent(1)
    watch.done(1, 0.01)
    watch.sent(1)
    clock.now += 1.5
    assert watch.due()
    watch.start_probe()
    assert not watch.due()  # one probe at a time
    assert watch.probed() is False and not watch.due()  # alive: wait another deadline
    clock.now += 4.0
    assert watch.due()
    watch.start_probe()
    assert watch.probed() is True  # 5.5 s without progress: stalled although every stage answers


@pytest.mark.parametrize("code, failed_stage, blamed", [
    ("stage_unreachable", 2, 2),  # a broken stream: the node that closed it
    ("shard_corrupt", 2, 1),  # corrupt input at stage 2: the sender, stage 1
    ("shard_corrupt", 0, None),  # token ids into stage 0 come from the leader: no node to exclude
    ("internal", 1, 1),
    ("shard_not_loaded", -1, None),  # a restarted node: re-deploy, exclude nobody
    ("kv_missing", 1, None),
])
def test_blame_falls_on_the_node_at_fault(code, failed_stage, blamed):
    failure = blame(StepResult(7, error_code=code, failed_stage=failed_stage, error_message="x"), num_stages=3)
    assert failure is not None and failure.stage_index == blamed and failure.code == code


def test_errors_of_the_request_itself_blame_no_node():
    for code in ("malformed_message", "context_length_exceeded", "bad_request"):
        assert blame(StepResult(7, error_code=code, failed_stage=1), num_stages=3) is None
