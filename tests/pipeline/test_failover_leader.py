"""The leader's failover with the real model in process: a transport that dies (or hangs) at a
chosen step, and a replanner that hands out a fresh in-process pipeline, so every path of the
loop (rebuild KV from committed tokens, give up, no plan, stall, requests during a re-plan)
is checked in seconds. Multi-process failover is in test_failover.py."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import replace

import pytest

from meshllm.engine.sampler import SamplingParams
from meshllm.engine.step import Step, StepResult
from meshllm.errors import ShardUnavailable
from meshllm.pipeline.cluster import local_leader, local_transport, new_leader
from meshllm.pipeline.events import LeaderObserver
from meshllm.pipeline.failover import Deployment, FailoverConfig, StageProbe
from meshllm.pipeline.transport import IdleEnd, LocalPipeline
from tests.pipeline.conftest import OPTIONS

PROMPT = "Once upon a time there was a little robot who"


class DyingPipeline(LocalPipeline):
    """The real in-process stage, until its `die_at`-th step (counting steps with work): from then
    on every step fails as a stage whose stream broke, or, with `hang`, is never answered."""

    def __init__(self, runners, die_at: int | None, hang: bool = False):
        super().__init__(runners)
        self.die_at = die_at
        self.hang = hang
        self.num_steps = 0

    def submit(self, step: Step) -> Future:
        if step.seqs:
            self.num_steps += 1
        if self.die_at is not None and self.num_steps >= self.die_at:
            future: Future = Future()
            if not self.hang:
                future.set_result(StepResult(step.step_id, error_code="stage_unreachable", failed_stage=0,
                                             error_message="stage 0 stream ended: UNAVAILABLE"))
            return future
        return super().submit(step)

    def watch(self, on_idle_end) -> None:
        self.on_idle_end = on_idle_end  # the test plays the stream's end (RemotePipeline calls it)


class Replanner:
    """Hands out pipelines from `die_at` in order (None: healthy), or raises `errors` first."""

    def __init__(self, files, die_at: list[int | None], hang: bool = False):
        self.files = files
        self.die_at = list(die_at)
        self.hang = hang
        self.errors: list[Exception] = []
        self.failures = []
        self.gate = threading.Event()
        self.gate.set()
        self.current: DyingPipeline | None = None
        self.num_probes = 0

    def first(self) -> DyingPipeline:
        self.current = self._next()
        return self.current

    def _next(self) -> DyingPipeline:
        runners = local_transport(self.files, OPTIONS).runners
        return DyingPipeline(runners, self.die_at.pop(0) if self.die_at else None, self.hang)

    def recover(self, failure, carry=None):
        self.failures.append(failure)
        assert self.gate.wait(30)
        if self.errors:
            raise self.errors.pop(0)
        self.current = self._next()
        return Deployment(self.current, plan_s=0.01, load_s=0.02, description="in process")

    def probe(self, timeout_s: float) -> StageProbe:
        self.num_probes += 1
        return StageProbe(unresponsive=(0,) if self.current is not None and self.current.hang else ())


class Recorder(LeaderObserver):
    def __init__(self):
        self.failures, self.recoveries, self.stalls = [], [], 0

    def on_failure(self, failure):
        self.failures.append(failure)

    def on_recovered(self, timing):
        self.recoveries.append(timing)

    def on_stall(self):
        self.stalls += 1


@pytest.fixture(scope="module")
def files(model_files):
    return model_files["aidreams"]


@pytest.fixture(scope="module")
def reference(files):
    leader = local_leader(files, OPTIONS)
    cache = {}

    def run(ids, params):
        key = (tuple(ids), params)
        if key not in cache:
            cache[key] = [e.token_id for e in leader.generate(ids, params) if e.token_id is not None]
        return cache[key]

    yield run
    leader.close()


def failover_leader(files, replanner, observer=None, options=OPTIONS, **kwargs):
    options = replace(options, **kwargs)
    return new_leader(files, replanner.first(), options, observer, replanner=replanner)


def run(leader, ids, params) -> tuple[list[int], list]:
    events = list(leader.generate(ids, params))
    return [e.token_id for e in events if e.token_id is not None], events


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("die_at", [1, 2, 3, 9, 20])  # in the prompt's first chunk, its second, then decoding
def test_greedy_output_survives_a_dead_stage_token_for_token(files, reference, die_at):
    ids = files.tokenizer.encode(PROMPT * 2)  # 2 prefill chunks of 32
    replanner = Replanner(files, [die_at])
    recorder = Recorder()
    leader = failover_leader(files, replanner, recorder)
    try:
        out, events = run(leader, ids, GREEDY)
    finally:
        leader.close()
    assert out == reference(ids, GREEDY)
    assert events[-1].finish_reason == "length" and events[-1].error is None
    assert [f.code for f in recorder.failures] == ["stage_unreachable"] and recorder.failures[0].stage_index == 0
    assert len(recorder.recoveries) == 1 and recorder.recoveries[0].load_s == 0.02


def test_seeded_sampling_and_concurrent_sequences_survive_two_failovers(files, reference):
    base = files.tokenizer.encode(PROMPT * 3)
    jobs = [(base[:5 + 9 * i], SamplingParams(temperature=0.8, seed=100 + i, max_tokens=10 + 3 * i,
                                              ignore_eos=True)) for i in range(4)]
    replanner = Replanner(files, [6, 5])
    leader = failover_leader(files, replanner)
    try:
        streams = []
        for ids, params in jobs:  # all submitted at once: they share micro-batches and both failovers
            events: queue.Queue = queue.Queue()
            leader.submit(ids, params, events.put)
            streams.append(events)
        for (ids, params), events in zip(jobs, streams):
            out = []
            while True:
                event = events.get(timeout=60)
                assert event.error is None, event.error
                if event.token_id is not None:
                    out.append(event.token_id)
                if event.finish_reason:
                    break
            assert out == reference(ids, params)
    finally:
        leader.close()
    assert len(replanner.failures) == 2


def test_a_request_gives_up_after_its_failover_limit(files):
    replanner = Replanner(files, [3, 2, 2, 2, 2])  # every plan dies soon
    leader = failover_leader(files, replanner, failover=FailoverConfig(max_failovers=2))
    started = time.monotonic()
    try:
        out, events = run(leader, files.tokenizer.encode(PROMPT), GREEDY)
    finally:
        leader.close()
    assert events[-1].finish_reason == "error" and events[-1].error.code == "pipeline_stalled"
    assert "after 2 failovers" in str(events[-1].error)
    assert len(replanner.failures) == 3 and time.monotonic() - started < 60


def test_no_plan_fails_clearly_and_the_next_request_gets_one(files, reference):
    replanner = Replanner(files, [3])
    missing = ShardUnavailable("aidreams layers 0-3 need 5.6 MB; the fleet can hold 4.1 MB; 1.5 MB missing",
                               missing_bytes=1_500_000, part="layers 2-3")
    replanner.errors = [missing]
    leader = failover_leader(files, replanner)
    ids = files.tokenizer.encode(PROMPT)
    try:
        out, events = run(leader, ids, GREEDY)
        assert events[-1].error is missing  # the in-flight request learns what is missing
        assert leader.transport is None
        out, events = run(leader, ids, GREEDY)  # the next request asks for a plan, and gets one
        assert out == reference(ids, GREEDY) and events[-1].error is None
    finally:
        leader.close()


def test_a_hung_stage_is_detected_by_the_deadline_and_probe(files, reference):
    from meshllm.pipeline.deadline import DeadlineConfig
    from meshllm.pipeline.leader import Leader

    replanner = Replanner(files, [12], hang=True)
    recorder = Recorder()
    transport = replanner.first()
    leader = Leader(transport, eos_token_ids=(),
                    new_detokenizer=lambda context: files.tokenizer.decode_stream(context=context).step,
                    max_context=128, config=OPTIONS.scheduler_config(128), observer=recorder, replanner=replanner,
                    deadline=DeadlineConfig(floor_s=0.3, cap_s=20.0, probe_timeout_s=0.1))
    replanner.hang = False  # the replacement answers
    ids = files.tokenizer.encode(PROMPT)
    started = time.monotonic()
    try:
        out, events = run(leader, ids, GREEDY)
    finally:
        leader.close()
    assert out == reference(ids, GREEDY)
    assert recorder.stalls == 1 and recorder.failures[0].code == "pipeline_stalled"
    assert 0.25 <= recorder.failures[0].detect_s < 5.0  # the floor, not the 20 s cap
    assert time.monotonic() - started < 15


def test_the_loop_answers_submits_and_cancels_while_it_replans(files, reference):
    replanner = Replanner(files, [4])
    replanner.gate.clear()  # the re-plan blocks until released
    leader = failover_leader(files, replanner)
    ids = files.tokenizer.encode(PROMPT)
    try:
        first: queue.Queue = queue.Queue()
        first_id = leader.submit(ids, GREEDY, first.put)
        deadline = time.monotonic() + 30
        while not replanner.failures:  # the pipeline died: the re-plan is blocked
            assert time.monotonic() < deadline
            time.sleep(0.01)
        leader.cancel(first_id)
        while (event := first.get(timeout=10)).finish_reason is None:
            pass
        assert event.finish_reason == "cancelled"
        second: queue.Queue = queue.Queue()
        leader.submit(ids, GREEDY, second.put)  # returns at once: the loop is not blocked
        replanner.gate.set()
        out = []
        while (event := second.get(timeout=60)).finish_reason is None:
            out.append(event.token_id)
        out.append(event.token_id)
        assert [t for t in out if t is not None] == reference(ids, GREEDY)
    finally:
        leader.close()


def test_a_stage_dying_between_requests_is_noticed_without_a_request(files, reference):
    """Nothing in flight, so no step can fail: the leader's routine health checks find the dead
    stage and re-plan at once, and the next request is served by the new plan."""
    replanner = Replanner(files, [None, None])
    recorder = Recorder()
    leader = failover_leader(files, replanner, recorder,
                             failover=FailoverConfig(idle_probe_interval_s=0.2, idle_probe_timeout_s=0.5))
    ids = files.tokenizer.encode(PROMPT)
    try:
        assert run(leader, ids, GREEDY)[0] == reference(ids, GREEDY)
        first = replanner.current
        first.hang = True  # from now on its health checks go unanswered (Replanner.probe)
        deadline = time.monotonic() + 10
        while not replanner.failures:  # no request is sent meanwhile
            assert time.monotonic() < deadline, "the idle leader never noticed its dead stage"
            time.sleep(0.05)
        assert recorder.failures[0].code == "stage_unreachable" and "between requests" in recorder.failures[0].message
        out, events = run(leader, ids, GREEDY)
        assert out == reference(ids, GREEDY) and events[-1].error is None
        assert replanner.current is not first  # served by the replacement
    finally:
        leader.close()


def test_a_stream_ending_between_requests_starts_the_failover_at_once(files, reference):
    """Idle, a stage dies: its stream's end (transport.IdleEnd) is all the leader hears. Closed by
    stage 0 (a later stage died): probe now, once, not at the next routine check (60 s away
    here); broken (a gRPC error: stage 0 died, or only its channel was closed): probe now too, so a
    healthy stage 0 is not failed over for a blip, and a dead one is blamed."""
    replanner = Replanner(files, [None, None, None])
    recorder = Recorder()
    leader = failover_leader(files, replanner, recorder, failover=FailoverConfig(idle_probe_interval_s=60.0))
    ids = files.tokenizer.encode(PROMPT)

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 2.0
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    try:
        assert run(leader, ids, GREEDY)[0] == reference(ids, GREEDY)
        first = replanner.current
        for _ in range(3):  # closed while every stage answers (a spurious end): probed, nothing more
            first.on_idle_end(IdleEnd(False, "stream closed"))
        wait_for(lambda: replanner.num_probes >= 1, "no probe after the stream ended")
        time.sleep(0.3)
        assert 1 <= replanner.num_probes <= 2 and not replanner.failures  # one probe (a second when they overlap)
        first.hang = True  # now a stage is dead: the next end finds it at once
        first.on_idle_end(IdleEnd(False, "stream closed"))
        wait_for(lambda: replanner.failures, "the closed stream did not lead to a re-plan")
        assert recorder.failures[0].code == "stage_unreachable" and recorder.failures[0].stage_index == 0
        wait_for(lambda: replanner.current is not first and leader.transport is replanner.current, "no new plan")
        second = replanner.current
        first.on_idle_end(IdleEnd(True, "UNAVAILABLE: Socket closed"))  # about a replaced transport: ignored
        probes = replanner.num_probes
        second.on_idle_end(IdleEnd(True, "CANCELLED: Channel closed"))  # a blip: every stage answers
        wait_for(lambda: replanner.num_probes > probes, "no probe after the stream broke")
        time.sleep(0.3)
        assert len(replanner.failures) == 1
        second.hang = True  # stage 0 is gone for real this time
        second.on_idle_end(IdleEnd(True, "UNAVAILABLE: Socket closed"))
        wait_for(lambda: len(replanner.failures) == 2, "the broken stream did not lead to a re-plan")
        failure = recorder.failures[1]
        assert failure.stage_index == 0 and failure.code == "stage_unreachable"
        out, events = run(leader, ids, GREEDY)
        assert out == reference(ids, GREEDY) and events[-1].error is None
        assert len(replanner.failures) == 2
    finally:
        leader.close()
