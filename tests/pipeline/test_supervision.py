"""The leader's loop survives its own bugs: the requests a failing turn touched end with an error,
the loop keeps serving, and when it cannot, `failure` (and /health) says so and `submit` raises
at once instead of blocking forever.

The faults are injected (a metrics observer or a transport that raises, as a bug there would);
everything else is real: aidreams weights, the in-process pipeline, the real HTTP API.
"""

from __future__ import annotations

import logging
import queue
import time

import httpx
import pytest

from meshllm.api.backend import Backend
from meshllm.api.metrics import MetricsObserver
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_runner import StageRunner
from meshllm.errors import LeaderDown
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions, context_of, new_leader
from meshllm.pipeline.transport import LocalPipeline
from tests.api.conftest import serve

OPTIONS = ServingOptions(context_length=128, max_batch=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SECRET = "my bank password is hunter2"  # a prompt's words must never reach the log at info level


class FaultyObserver(MetricsObserver):
    """Raises on the chosen calls, as a bug in metrics code would (it runs on the loop thread)."""

    def __init__(self, fail_steps: set[int] = frozenset(), always_on_queue: bool = False):
        super().__init__()
        self.fail_steps, self.always_on_queue, self.num_steps = set(fail_steps), always_on_queue, 0

    def on_step(self, batch, result, seconds):
        self.num_steps += 1
        if self.num_steps in self.fail_steps:
            raise RuntimeError(f"metrics bug while reporting {SECRET}")
        super().on_step(batch, result, seconds)

    def on_queue(self, num_waiting, num_running):
        if self.always_on_queue:
            raise KeyError(SECRET)
        super().on_queue(num_waiting, num_running)


class FlakyPipeline(LocalPipeline):
    """The real in-process stage, whose submit raises once: a fault while scheduling, where the
    leader cannot tell which requests are affected. On the `fail_on`-th submit, or on the first
    step of `fail_at_seqs` sequences (steps run on the leader's thread, at once: a count of
    submits races with requests still being submitted)."""

    def __init__(self, runners, fail_on: int = 0, fail_at_seqs: int = 0):
        super().__init__(runners)
        self.fail_on, self.fail_at_seqs, self.num_submits, self.failed = fail_on, fail_at_seqs, 0, False

    def submit(self, step):
        self.num_submits += 1
        if not self.failed and (self.num_submits == self.fail_on or 0 < self.fail_at_seqs == len(step.seqs)):
            self.failed = True
            raise RuntimeError("transport bug")
        return super().submit(step)


@pytest.fixture(scope="module")
def files(aidreams_path):
    return open_model(aidreams_path)


@pytest.fixture(scope="module")
def decoder(files):
    return load_decoder(files.source, files.config)


def leader_with(files, decoder, observer=None, pipeline=None):
    return new_leader(files, pipeline or LocalPipeline([StageRunner(decoder)]), OPTIONS, observer)


def run(leader, prompt_ids, params=GREEDY):
    events = list(leader.generate(prompt_ids, params))
    return [e.token_id for e in events if e.token_id is not None], events[-1]


def test_a_fault_fails_only_the_requests_it_touched_and_the_loop_keeps_serving(files, decoder, caplog):
    prompt = files.tokenizer.encode(SECRET)
    reference = leader_with(files, decoder)
    try:
        expected, _ = run(reference, prompt)
    finally:
        reference.close()
    leader = leader_with(files, decoder, FaultyObserver(fail_steps={3}))
    try:
        with caplog.at_level(logging.DEBUG, logger="meshllm"):
            tokens, last = run(leader, prompt)  # its third step's report raises
        assert last.finish_reason == "error" and "internal error in the leader" in str(last.error)
        assert len(tokens) < GREEDY.max_tokens
        tokens, last = run(leader, prompt)  # the same leader serves the next request, exactly as before
        assert last.finish_reason == "length" and tokens == expected
        assert leader.failure is None
    finally:
        leader.close()
    assert any(r.levelno == logging.ERROR and "RuntimeError" in r.getMessage() for r in caplog.records)
    assert not any(SECRET in r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)


def test_a_fault_while_scheduling_fails_every_request_frees_their_kv_and_serving_goes_on(files, decoder):
    runner = StageRunner(decoder)
    leader = leader_with(files, decoder, pipeline=FlakyPipeline([runner], fail_at_seqs=3))  # all three running
    prompt = files.tokenizer.encode("Once upon a time")
    try:
        streams = [queue.Queue() for _ in range(3)]
        for events in streams:
            leader.submit(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), events.put)
        for events in streams:  # every request ends, none hangs
            while (event := events.get(timeout=30)).finish_reason is None:
                pass
            assert event.finish_reason == "error"
        tokens, last = run(leader, prompt)
        assert last.finish_reason == "length" and len(tokens) == GREEDY.max_tokens
        deadline = time.monotonic() + 10
        while runner.held_sequences() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.held_sequences() == []  # the failed sequences were released on the stage
    finally:
        leader.close()


def test_a_fault_while_sending_a_finished_sequences_release_still_frees_its_kv(files, decoder):
    # A request that ended has its release ride the next step; the submit of that step raises.
    # The recovery starts from fresh chores: the release was lost and the KV held for the
    # stream's life (counted against the plan's batch: later full batches were refused).
    runner = StageRunner(decoder)
    leader = leader_with(files, decoder, pipeline=FlakyPipeline([runner], fail_on=2))
    try:
        tokens, last = run(leader, files.tokenizer.encode("Once upon a time"),
                           SamplingParams(temperature=0.0, max_tokens=1))
        assert last.finish_reason == "length" and len(tokens) == 1
        deadline = time.monotonic() + 10
        while runner.held_sequences() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.held_sequences() == []
        assert run(leader, files.tokenizer.encode("Hello"))[1].finish_reason == "length"  # serving goes on
    finally:
        leader.close()


def test_a_callback_raising_on_its_last_token_fails_no_other_request(files, decoder):
    # _deliver finishes the request before its last event; the handler finished it again
    # (KeyError), and the supervisor then failed every request of the batch.
    leader = leader_with(files, decoder)
    prompt = files.tokenizer.encode("Once upon a time")
    try:
        other = queue.Queue()

        def breaks_at_the_end(event):
            if event.finish_reason is not None:
                raise RuntimeError("a caller's bug")

        leader.submit(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), breaks_at_the_end)
        leader.submit(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), other.put)
        while (event := other.get(timeout=30)).finish_reason is None:
            pass
        assert event.finish_reason == "length" and event.error is None
        assert leader.failure is None
    finally:
        leader.close()


def test_a_loop_that_keeps_failing_gives_up_and_says_so_on_health_and_submit(files, decoder):
    metrics = FaultyObserver(always_on_queue=True)
    leader = leader_with(files, decoder, metrics)
    backend = Backend(files.model_id, files.tokenizer, context_of(files, OPTIONS), leader, metrics)
    prompt = files.tokenizer.encode("Hello")
    try:
        with serve(backend) as live:
            assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200
            for _ in range(10):  # each submit trips the fault; after a few the supervisor gives up
                try:
                    leader.submit(prompt, GREEDY, lambda event: None)
                except LeaderDown:
                    break
                except Exception:  # noqa: BLE001 - the earlier ones are refused with an internal error
                    pass
            assert isinstance(leader.failure, LeaderDown)
            started = time.monotonic()
            with pytest.raises(LeaderDown, match="stopped serving"):
                leader.submit(prompt, GREEDY, lambda event: None)
            assert time.monotonic() - started < 1.0  # refused at once, not after a wait
            health = httpx.get(f"{live.url}/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "unavailable"
            assert health.json()["reason"].startswith("[leader_down] the leader stopped serving")
            reply = httpx.post(f"{live.url}/v1/completions", json={"model": files.model_id, "prompt": "Hi"},
                               timeout=10)
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "leader_down"
            leader._thread.join(timeout=5)
            assert not leader._thread.is_alive()  # stopped on purpose, not wedged
    finally:
        leader.close()
