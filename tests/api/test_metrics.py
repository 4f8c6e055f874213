"""The Prometheus observer: hook by hook, and as /metrics after real requests."""

from __future__ import annotations

import httpx
import pytest

from meshllm.api.metrics import MetricsObserver
from meshllm.engine.kv_cache import SeqId
from meshllm.engine.scheduler import MicroBatch, Work
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.sequence import Sequence
from meshllm.engine.step import StageTiming, StepResult
from meshllm.spec.proposer import ProposerError

from .conftest import MODEL

pytestmark = pytest.mark.timeout(120)


def sample(observer: MetricsObserver, name: str, **labels) -> float | None:
    return observer.registry.get_sample_value(name, labels)


def test_step_hook_records_stage_compute_and_hop_latency():
    m = MetricsObserver()
    seq = Sequence(SeqId(1), [1, 2, 3], SamplingParams())
    batch = MicroBatch((Work(seq, 0, 3, 1),))
    timings = (StageTiming(0, 0.010, 0.0, 0.0), StageTiming(1, 0.020, 0.0, 0.0))
    m.on_step(batch, StepResult(7, (), timings), seconds=0.060)
    assert sample(m, "meshllm_stage_compute_seconds_sum", stage="0") == pytest.approx(0.010)
    assert sample(m, "meshllm_stage_compute_seconds_sum", stage="1") == pytest.approx(0.020)
    # 4 hops (leader -> stage 0 -> stage 1, and the tokens relayed back stage 1 -> stage 0 -> leader)
    # share 60 - 30 ms.
    assert sample(m, "meshllm_hop_seconds_sum") == pytest.approx(0.0075)
    assert sample(m, "meshllm_step_seconds_count") == 1
    assert sample(m, "meshllm_computed_tokens_total") == 3
    # A failed step counts as a step but has no stage timings to trust.
    m.on_step(batch, StepResult(8, error_code="shard_corrupt", failed_stage=1), seconds=0.5)
    assert sample(m, "meshllm_step_seconds_count") == 2
    assert sample(m, "meshllm_hop_seconds_count") == 1


def test_token_finish_queue_and_prefix_hooks():
    m = MetricsObserver()
    m.on_token(True, 0.2)
    m.on_token(False, 0.01)
    m.on_token(False, 0.03)
    assert sample(m, "meshllm_time_to_first_token_seconds_count") == 1
    assert sample(m, "meshllm_time_to_first_token_seconds_sum") == pytest.approx(0.2)
    assert sample(m, "meshllm_inter_token_latency_seconds_count") == 2
    assert sample(m, "meshllm_generated_tokens_total") == 3 == m.num_generated_tokens
    assert m.recent_tokens_per_second() == pytest.approx(0.3)  # 3 tokens over the 10 s window
    m.on_finish("stop", 3)
    m.on_finish("cancelled", 1)
    m.on_finish("stop", 5)
    assert sample(m, "meshllm_finished_sequences_total", finish_reason="stop") == 2
    assert sample(m, "meshllm_finished_sequences_total", finish_reason="cancelled") == 1
    m.on_queue(4, 2)
    assert (sample(m, "meshllm_queue_depth"), sample(m, "meshllm_running_sequences")) == (4, 2)
    assert (m.num_waiting, m.num_running) == (4, 2)
    m.on_prefix(64, 10)
    m.on_prefix(0, 5)
    assert sample(m, "meshllm_prefix_cache_hit_tokens_total") == 64
    assert sample(m, "meshllm_prefix_cache_miss_tokens_total") == 15


def test_speculation_hooks():
    m = MetricsObserver()
    m.on_verified(4, 3)
    m.on_verified(0, 0)  # a plain pass
    m.on_proposer_failed(ProposerError("proposer x on n: DEADLINE_EXCEEDED: late"))
    m.on_proposer_failed(ProposerError("proposer x on n: INVALID_ARGUMENT: refused"))
    assert sample(m, "meshllm_spec_drafted_tokens_total") == 4
    assert sample(m, "meshllm_spec_accepted_tokens_total") == 3
    assert sample(m, "meshllm_spec_acceptance_rate") == pytest.approx(0.75)
    assert sample(m, "meshllm_spec_tokens_per_verifier_pass") == pytest.approx(2.5)  # (2 passes + 3) / 2
    assert sample(m, "meshllm_spec_proposer_failures_total") == 2


def test_observers_keep_separate_registries():
    a, b = MetricsObserver(), MetricsObserver()
    a.on_token(True, 0.1)
    assert sample(a, "meshllm_generated_tokens_total") == 1
    assert sample(b, "meshllm_generated_tokens_total") == 0


def test_metrics_endpoint_after_real_requests(server):
    before_tokens = server.metric("meshllm_generated_tokens_total")
    before_ttft = server.metric("meshllm_time_to_first_token_seconds_count")
    client = server.client()
    usage = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).usage
             for p in ("Once", "The stars")]
    assert server.metric("meshllm_generated_tokens_total") - before_tokens == sum(u.completion_tokens for u in usage)
    assert server.metric("meshllm_time_to_first_token_seconds_count") - before_ttft == 2
    assert server.metric("meshllm_inter_token_latency_seconds_count") > 0
    assert server.metric("meshllm_stage_compute_seconds_count", {"stage": "0"}) > 0
    assert server.metric("meshllm_prefix_cache_miss_tokens_total") > 0
    assert server.metric("meshllm_running_sequences") == 0
    response = httpx.get(f"{server.url}/metrics", timeout=10)
    assert response.headers["content-type"].startswith("text/plain")
    assert "# TYPE meshllm_hop_seconds histogram" in response.text
