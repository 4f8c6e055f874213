"""Bad requests get the right status and an OpenAI-shaped error body, and the server keeps serving."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from meshllm.api.backend import Backend
from meshllm.api.config import APIConfig
from meshllm.errors import ShardUnavailable
from meshllm.pipeline.health import HealthReport, HealthStatus, ServingHealth

from .conftest import MODEL, serve

pytestmark = pytest.mark.timeout(120)


def post(url: str, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def assert_still_serving(url: str) -> None:
    reply = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path, body, status, code, param", [
    (CHAT, b'{"model": "aidreams-260k", "messages": [', 400, "invalid_json", None),
    (COMPLETIONS, b"not json at all", 400, "invalid_json", None),
    (CHAT, {"model": MODEL, "messages": "Hi"}, 400, "invalid_value", "messages"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": "ten"}, 400, "invalid_value", "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, 400, "invalid_value", "temperature"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": -5}, 400, "invalid_value", "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "n": 0}, 400, "invalid_value", "n"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "invalid_value", "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]}, 400, "invalid_value", None),
    (CHAT, {"messages": MESSAGES}, 400, "invalid_value", "model"),
    (CHAT, {"model": None, "messages": MESSAGES}, 400, "invalid_value", "model"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "invalid_value", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "presence_penalty": 2.5}, 400, "bad_request", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "frequency_penalty": -3}, 400, "bad_request", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "logit_bias": {"5": 150}}, 400, "bad_request", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "logit_bias": {"99999": 1}}, 400, "bad_request", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "logit_bias": {"the": 1}}, 400, "bad_request", None),
    (COMPLETIONS, {"model": MODEL, "prompt": "Hi", "repetition_penalty": 0}, 400, "bad_request", None),
    (COMPLETIONS, {"model": MODEL, "prompt": "Hi", "min_p": 1.5}, 400, "bad_request", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "tool_choice": "required"}, 400, "invalid_value", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "invalid_value", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     400, "invalid_value", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400, "invalid_value",
     None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wizard"}}}}}}, 400, "bad_request",
     None),
    # Schemas that compiled into a TypeError or llguidance's ValueError: 500s before.
    (CHAT, {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "x-guidance": None}}}}, 400, "bad_request", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "const": "\ud800"}}}}, 400, "bad_request", None),
    (COMPLETIONS, {"model": MODEL, "prompt": 42}, 400, "invalid_value", None),
    (COMPLETIONS, {"model": MODEL, "prompt": "Hi", "top_p": -0.1}, 400, "invalid_value", "top_p"),
    (COMPLETIONS, {"model": MODEL, "prompt": "Hi", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, 99999]}, 400, "bad_request", None),
    (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "bad_request", None),
    (COMPLETIONS, {"model": MODEL, "prompt": [[5, 6], []]}, 400, "bad_request", None),
    (COMPLETIONS, {"model": MODEL, "prompt": "Hi", "top_k": -2}, 400, "invalid_value", "top_k"),
    (COMPLETIONS, {"model": MODEL, "prompt": "Hi", "stop": [""]}, 400, "bad_request", None),
    (COMPLETIONS, {"model": MODEL, "prompt": "Hi " * 200}, 400, "context_length_exceeded", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 120}, 400, "context_length_exceeded", None),
    (CHAT, {"model": "gpt-4o", "messages": MESSAGES}, 404, "model_not_found", None),
    (COMPLETIONS, {"model": "nope", "prompt": "Hi"}, 404, "model_not_found", None),
])
def test_bad_request_status_and_body(server, path, body, status, code, param):
    assert_error(post(server.url, path, body), status, code, param)
    assert_still_serving(server.url)


def test_a_bug_is_an_openai_shaped_500_and_the_server_keeps_serving(backend, monkeypatch):
    """An exception no handler expects (a bug) gets an OpenAI-shaped 500 that clients parse, not
    Starlette's plain text. (A chat's prompt building is made to fail: nothing real does on purpose.)"""
    import meshllm.api.app as app_module

    def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "chat_choices", broken)
    with serve(backend) as live:
        error = assert_error(post(live.url, CHAT, {"model": MODEL, "messages": MESSAGES}), 500, "internal_error")
        assert error["type"] == "server_error" and "RuntimeError" in error["message"]
        assert_still_serving(live.url)


def test_unknown_route_is_an_openai_error(server):
    assert_error(httpx.get(f"{server.url}/v1/embeddings", timeout=10), 404, "not_found")
    assert_error(httpx.get(f"{server.url}/v1/completions", timeout=10), 405, "method_not_allowed")


def test_openai_client_raises_the_matching_exceptions(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Hi " * 200)
    assert caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:  # validation: 400 as from OpenAI, not 422
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-1)
    assert caught.value.body["code"] == "invalid_value" and caught.value.body["param"] == "max_tokens"


def test_api_key(backend):
    with serve(backend, APIConfig(port=0, api_key="s3cret")) as live:
        with pytest.raises(openai.AuthenticationError) as caught:
            live.client(api_key="wrong").models.list()
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
        # No key at all, and a bad key with a malformed body: refused before the body is looked at.
        assert_error(post(live.url, COMPLETIONS, {"model": MODEL, "prompt": "Hi"}), 401, "invalid_api_key")
        assert_error(post(live.url, CHAT, b"{", {"authorization": "Bearer nope"}), 401, "invalid_api_key")
        assert_error(post(live.url, CHAT, {"model": MODEL, "messages": MESSAGES}, {"authorization": "s3cret"}),
                     401, "invalid_api_key")
        reply = live.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
        assert reply.choices[0].message.content is not None
        # Probes and monitoring stay open: they show no prompts, addresses or topology.
        assert httpx.get(f"{live.url}/metrics", timeout=10).status_code == 200
        assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200
        # Everything else needs the key: the fleet view shows addresses and memory.
        for path in ("/v1/cluster", "/v1/models", f"/v1/models/{MODEL}", "/openapi.json", "/v1/nowhere"):
            assert_error(httpx.get(f"{live.url}{path}", timeout=10), 401, "invalid_api_key")
        keyed = {"authorization": "Bearer s3cret"}
        assert httpx.get(f"{live.url}/v1/cluster", headers=keyed, timeout=10).json()["served"]["model_id"] == MODEL


def test_full_queue_answers_429_and_recovers(slow_backend):
    """One sequence runs and one waits (max_batch 1, max_queue 1): a third request is refused."""
    with serve(slow_backend) as live:
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 100, "ignore_eos": True, "stream": True}
        stop = threading.Event()
        statuses: list[int] = []

        def hold_stream() -> None:
            with httpx.Client(timeout=60) as http, http.stream("POST", f"{live.url}{COMPLETIONS}", json=body) as r:
                statuses.append(r.status_code)
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

        holders = [threading.Thread(target=hold_stream) for _ in range(2)]
        try:
            # One after the other, so that the first is the one running.
            holders[0].start()
            live.wait_for(lambda: live.metric("meshllm_running_sequences") == 1, what="the first to run")
            holders[1].start()
            live.wait_for(lambda: live.metric("meshllm_running_sequences") == 1
                          and live.metric("meshllm_queue_depth") == 1, what="one running and one waiting")
            error = assert_error(post(live.url, COMPLETIONS, {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
                                 429, "queue_full")
            assert error["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                live.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        finally:
            stop.set()
            for t in holders:
                t.join(timeout=30)
        live.wait_for(lambda: live.metric("meshllm_running_sequences") == 0
                      and live.metric("meshllm_queue_depth") == 0, what="the held requests to be cancelled")
        assert statuses == [200, 200]
        assert_still_serving(live.url)
        # Two sequences at once fit (one runs, one waits), however fast they reach the leader.
        both = post(live.url, COMPLETIONS, {"model": MODEL, "prompt": ["Once", "Upon"], "max_tokens": 2})
        assert both.status_code == 200 and len(both.json()["choices"]) == 2
        # More than it can ever hold is no "retry later": a 400 that says how many fit.
        error = assert_error(post(live.url, COMPLETIONS, {"model": MODEL, "prompt": "Once", "max_tokens": 2, "n": 3}),
                             400, "bad_request")
        assert "holds at most 2" in error["message"]


def test_no_plan_answers_503(aidreams_files):
    error = ShardUnavailable("aidreams-260k layers 0-3 need 0.1 GiB; the largest free node has 0.0 GiB. "
                             "Add a node or lower --max-context.")
    health = ServingHealth(HealthReport(HealthStatus.UNAVAILABLE, str(error)))
    backend = Backend(MODEL, aidreams_files.tokenizer, 128, leader=None, health=health)
    with serve(backend) as live:
        body = assert_error(post(live.url, CHAT, {"model": MODEL, "messages": MESSAGES}), 503, "shard_unavailable")
        assert "Add a node" in body["message"]
        with pytest.raises(openai.InternalServerError):
            live.client().completions.create(model=MODEL, prompt="Hi")
        reply = httpx.get(f"{live.url}/health", timeout=10)
        assert reply.status_code == 503 and reply.json()["status"] == "unavailable"
        assert httpx.head(f"{live.url}/health", timeout=10).status_code == 503  # monitoring probes use HEAD
        assert "Add a node" in reply.json()["reason"]
        view = httpx.get(f"{live.url}/v1/cluster", timeout=10).json()
        assert view["served"]["ready"] is False and "Add a node" in view["served"]["plan_error"]
        # The model is still listed: it exists, it just cannot run right now.
        assert [m.id for m in live.client().models.list()] == [MODEL]
