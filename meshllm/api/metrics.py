"""Prometheus metrics of one served model, fed by the leader's observer hooks.

Each app owns its CollectorRegistry (never the process-global one), so several
servers in one process (tests, a node serving two models) keep separate counts.
The hooks run on the leader's loop thread; prometheus_client's metrics are
thread-safe, and the throughput window has its own lock for the HTTP side.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the /metrics route)

from meshllm.engine.scheduler import MicroBatch
from meshllm.engine.step import StepResult
from meshllm.errors import MeshError
from meshllm.pipeline.events import LeaderObserver
from meshllm.pipeline.failover import RecoveryTiming, StageFailure
from meshllm.pipeline.health import HealthReport, HealthStatus

# Seconds; from a fast GPU decode step to a slow CPU prefill over a LAN.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_THROUGHPUT_WINDOW_S = 10  # whole seconds
# Failover: from a broken stream on loopback (tenths of a second) to loading gigabytes on a new node.
_RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class MetricsObserver(LeaderObserver):
    """The leader's observer: turns its hooks into Prometheus series in `self.registry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "meshllm_time_to_first_token_seconds", "From submission to the first generated token.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "meshllm_inter_token_latency_seconds", "Between consecutive tokens of one sequence.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.step_latency = Histogram(
            "meshllm_step_seconds", "Round trip of one micro-batch through every stage.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.stage_compute = Histogram(
            "meshllm_stage_compute_seconds", "Compute time of one micro-batch on one stage.",
            ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.hop_latency = Histogram(
            "meshllm_hop_seconds", "Transport time per hop: (step round trip - summed stage compute) / hops.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter(
            "meshllm_generated_tokens", "Tokens sampled for sequences (rate() gives tokens/s).", registry=r)
        self.computed_tokens = Counter(
            "meshllm_computed_tokens", "Tokens run through the model: prefill chunks and decode steps.",
            registry=r)
        self.finished_sequences = Counter(
            "meshllm_finished_sequences", "Sequences finished, by finish reason.", ["finish_reason"], registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "meshllm_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", registry=r)
        self.prefix_cache_miss_tokens = Counter(
            "meshllm_prefix_cache_miss_tokens", "Prompt tokens that had to be prefilled.", registry=r)
        self.waiting = Gauge("meshllm_queue_depth", "Sequences waiting for admission.", registry=r)
        self.running = Gauge("meshllm_running_sequences", "Sequences admitted and not finished.", registry=r)
        self.tokens_per_second = Gauge(
            "meshllm_generation_tokens_per_second",
            f"Tokens generated per second over the last {_THROUGHPUT_WINDOW_S} s.", registry=r)
        self.tokens_per_second.set_function(self.recent_tokens_per_second)
        self.drafted_tokens = Counter(
            "meshllm_spec_drafted_tokens", "Draft tokens sent for verification (speculative decoding).", registry=r)
        self.accepted_tokens = Counter(
            "meshllm_spec_accepted_tokens", "Draft tokens the verifier accepted.", registry=r)
        self.verifier_passes = Counter(
            "meshllm_spec_verifier_passes", "Decode passes of a sequence through the verifier (with or without "
            "a draft).", registry=r)
        self.acceptance_rate = Gauge(
            "meshllm_spec_acceptance_rate", "Accepted over drafted tokens since start.", registry=r)
        self.acceptance_rate.set_function(lambda: self._accepted / self._drafted if self._drafted else 0.0)
        self.tokens_per_pass = Gauge(
            "meshllm_spec_tokens_per_verifier_pass", "Tokens committed per decode pass since start (1 without "
            "speculation).", registry=r)
        self.tokens_per_pass.set_function(lambda: (self._passes + self._accepted) / self._passes if self._passes
                                          else 0.0)
        self.proposer_failures = Counter(
            "meshllm_spec_proposer_failures", "Proposer calls that failed (an error, a missed deadline, a refusal): "
            "their drafts were dropped and the leader decoded plainly for a moment.", registry=r)
        self.api_errors = Counter("meshllm_api_errors", "HTTP API errors, by error code.", ["code"], registry=r)
        # Failover (pipeline-sharding-spec §5.10 names, with our prefix).
        self.failovers = Counter("meshllm_failovers", "Failovers started: a stage failed or stalled and the "
                                 "leader re-planned, by error code.", ["code"], registry=r)
        self.recovery_seconds = Histogram(
            "meshllm_recovery_seconds", "From the last progress before a failure to the first token after the "
            "failover (detect + re-plan + load + re-prefill).", buckets=_RECOVERY_BUCKETS, registry=r)
        self.fallback_to_local = Counter("meshllm_fallback_to_local", "Times no plan fit the fleet and the "
                                         "leader ran the model alone (--fallback-local).", registry=r)
        self.shard_corruption_detected = Counter(
            "meshllm_shard_corruption_detected", "Steps refused for corrupt activations (NaN/Inf, wrong shape or "
            "dtype) or an invalid reply; the sending node is excluded.", registry=r)
        self.stalls = Counter("meshllm_stalls", "Stages declared stalled: no reply within the deadline and no "
                              "answer to a health check.", registry=r)
        self.health_status = Gauge("meshllm_serving_status", "1 for the served model's current health status "
                                   "(ok, degraded, unavailable), 0 for the others.", ["status"], registry=r)
        self._recent_recoveries: deque[RecoveryTiming] = deque(maxlen=20)
        self._lock = threading.Lock()
        self._recent: deque[list[int]] = deque()  # [whole monotonic second, tokens generated in it]
        self._num_waiting = 0
        self._num_running = 0
        self._num_generated_tokens = 0
        self._drafted = self._accepted = self._passes = 0

    # --- leader loop thread ------------------------------------------------------------------------
    def on_step(self, batch: MicroBatch, result: StepResult, seconds: float) -> None:
        self.step_latency.observe(seconds)
        self.computed_tokens.inc(batch.num_tokens)
        if not result.ok:
            return
        compute = 0.0
        for timing in result.timings:
            self.stage_compute.labels(stage=str(timing.stage_index)).observe(timing.compute_s)
            compute += timing.compute_s
        if result.timings:
            # leader -> stage 0 -> ... -> last stage, and the tokens relayed back the same way
            num_hops = 2 * len(result.timings)
            self.hop_latency.observe(max(seconds - compute, 0.0) / num_hops)

    def on_token(self, first: bool, seconds: float) -> None:
        (self.time_to_first_token if first else self.inter_token_latency).observe(seconds)
        self.generated_tokens.inc()
        self._num_generated_tokens += 1  # written by the leader thread only
        second = int(time.monotonic())
        with self._lock:
            if self._recent and self._recent[-1][0] == second:
                self._recent[-1][1] += 1
            else:
                self._recent.append([second, 1])
                self._drop_old(second)

    def on_finish(self, reason: str, num_tokens: int) -> None:
        self.finished_sequences.labels(finish_reason=reason).inc()

    def on_queue(self, num_waiting: int, num_running: int) -> None:
        self.waiting.set(num_waiting)
        self.running.set(num_running)
        self._num_waiting, self._num_running = num_waiting, num_running

    def on_failure(self, failure: StageFailure) -> None:
        self.failovers.labels(code=failure.code).inc()
        if failure.code in ("shard_corrupt", "invalid_reply"):
            self.shard_corruption_detected.inc()

    def on_stall(self) -> None:
        self.stalls.inc()

    def on_recovered(self, timing: RecoveryTiming) -> None:
        self.recovery_seconds.observe(timing.total_s)
        with self._lock:
            self._recent_recoveries.append(timing)

    def on_fallback_local(self) -> None:
        self.fallback_to_local.inc()

    def on_prefix(self, hit_tokens: int, miss_tokens: int) -> None:
        """Prefix-cache accounting of one admitted prompt (called by the scheduler once it has a prefix cache)."""
        self.prefix_cache_hit_tokens.inc(hit_tokens)
        self.prefix_cache_miss_tokens.inc(miss_tokens)

    def on_verified(self, num_drafted: int, num_accepted: int) -> None:
        self.verifier_passes.inc()
        self._passes += 1
        if num_drafted:
            self.drafted_tokens.inc(num_drafted)
            self.accepted_tokens.inc(num_accepted)
            self._drafted += num_drafted
            self._accepted += num_accepted

    def on_proposer_failed(self, error: MeshError) -> None:
        self.proposer_failures.inc()

    # --- any thread --------------------------------------------------------------------------------
    def on_health(self, report: HealthReport) -> None:
        """The plan owner changed the served model's health."""
        for status in HealthStatus:
            self.health_status.labels(status=status.value).set(1 if report.status is status else 0)

    def recent_recoveries(self) -> list[RecoveryTiming]:
        with self._lock:
            return list(self._recent_recoveries)

    def recent_tokens_per_second(self) -> float:
        with self._lock:
            self._drop_old(int(time.monotonic()))
            return sum(n for _, n in self._recent) / _THROUGHPUT_WINDOW_S

    def _drop_old(self, second: int) -> None:
        while self._recent and self._recent[0][0] <= second - _THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def num_generated_tokens(self) -> int:
        return self._num_generated_tokens

    def exposition(self) -> bytes:
        """The registry in Prometheus text format, for GET /metrics."""
        return generate_latest(self.registry)
