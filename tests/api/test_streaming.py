"""Streaming under load and cancellation: concurrent clients, disconnects, deadlines."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from meshllm.api.config import APIConfig
from meshllm.engine.sampler import SamplingParams

from .conftest import MODEL, serve

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["Once upon a time", "The stars", "A gentle hum", "Echoes of", "In the quiet", "Dimensions unfold",
           "Vectors", "I dream of", "The machine", "Light and", "Beneath the", "Whispers",
           "A tapestry of", "Numbers", "Silence", "The ocean of"]


def test_sixteen_concurrent_streams_equal_their_solo_runs(server, aidreams_files, reference):
    assert len(PROMPTS) == 16
    solo = [reference(aidreams_files.tokenizer.encode(p), SamplingParams(temperature=0, max_tokens=32))
            for p in PROMPTS]
    steps_before = server.metric("meshllm_step_seconds_count")
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(PROMPTS))

    def stream(i: int) -> None:
        try:
            client = server.client()
            start.wait(timeout=30)
            chunks = client.completions.create(model=MODEL, prompt=PROMPTS[i], temperature=0, max_tokens=32,
                                               stream=True)
            results[i] = "".join(c.choices[0].text for c in chunks if c.choices)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    # A completion's text continues its prompt's (the space before a first word kept): the solo
    # run's tokens, decoded after the prompt's.
    tokenizer = aidreams_files.tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [tokenizer.decode(p + list(c.token_ids))[len(tokenizer.decode(p)):] for p, c in zip(prompts, solo)]
    assert [results.get(i) for i in range(len(PROMPTS))] == expected
    # They really ran together: far fewer steps than tokens means sequences shared micro-batches.
    num_tokens = sum(len(c.token_ids) for c in solo)
    assert server.metric("meshllm_step_seconds_count") - steps_before < num_tokens / 2


def _read_some_then_disconnect(url: str, body: dict, num_chunks: int) -> list[dict]:
    chunks = []
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: "):]))
                if len(chunks) >= num_chunks:
                    break
    return chunks  # leaving both blocks closes the connection mid-stream


def test_client_disconnect_mid_stream_frees_the_sequence(slow_backend):
    with serve(slow_backend) as live:
        cancelled_before = live.metric("meshllm_finished_sequences_total", {"finish_reason": "cancelled"})
        body = dict(model=MODEL, prompt="Once upon a time", max_tokens=100, temperature=0, stream=True,
                    ignore_eos=True)
        chunks = _read_some_then_disconnect(live.url, body, num_chunks=3)
        assert len(chunks) == 3
        # 100 tokens take at least 2 s here; the cancellation must come long before that.
        live.wait_for(lambda: live.metric("meshllm_finished_sequences_total", {"finish_reason": "cancelled"})
                      == cancelled_before + 1, timeout_s=1.5, what="the sequence to be cancelled")
        live.wait_for(lambda: not live.stage_sequences(), timeout_s=5, what="the stage to release the KV")
        assert live.metric("meshllm_running_sequences") == 0
        # And the server keeps serving.
        reply = live.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop")


def test_client_giving_up_on_a_whole_reply_frees_the_sequence(slow_backend):
    with serve(slow_backend) as live:
        cancelled_before = live.metric("meshllm_finished_sequences_total", {"finish_reason": "cancelled"})
        with pytest.raises(openai.APITimeoutError):
            live.client(timeout=0.5).completions.create(model=MODEL, prompt="Once", max_tokens=100,
                                                        extra_body={"ignore_eos": True})
        live.wait_for(lambda: live.metric("meshllm_finished_sequences_total", {"finish_reason": "cancelled"})
                      == cancelled_before + 1, timeout_s=1.5, what="the sequence to be cancelled")
        live.wait_for(lambda: not live.stage_sequences(), timeout_s=5, what="the stage to release the KV")


def test_deadline_gives_504_before_output_and_an_error_event_after(slow_backend):
    with serve(slow_backend, APIConfig(port=0, request_timeout_s=0.6)) as live:
        client = live.client()
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model=MODEL, prompt="Once", max_tokens=100, extra_body={"ignore_eos": True})
        assert caught.value.status_code == 504
        assert caught.value.body["code"] == "request_timeout"
        assert time.monotonic() - started < 1.5

        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=100, stream=True, extra_body={"ignore_eos": True})
        received = []
        with pytest.raises(openai.APIError, match="request-timeout"):
            for chunk in stream:
                received.append(chunk)
        assert len(received) > 1  # the stream had started before the deadline ended it
        live.wait_for(lambda: live.metric("meshllm_running_sequences") == 0, what="the sequence to be cancelled")
        live.wait_for(lambda: not live.stage_sequences(), timeout_s=5, what="the stage to release the KV")
