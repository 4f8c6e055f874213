"""The HTTP edge under hostile sizes and text: bodies over the limit are refused unread and
fast while other requests go on; text that is not valid Unicode, or too long for any
context, is a 400 before it is tokenized; the OpenAPI document lists what is answered."""

from __future__ import annotations

import json
import threading
import time

import httpx
import psutil
import pytest

from meshllm.api.config import APIConfig

from .conftest import MODEL, serve
from .test_errors import CHAT, COMPLETIONS, MESSAGES, assert_error, assert_still_serving, post

pytestmark = pytest.mark.timeout(120)
MIB = 1024 * 1024


def test_a_20_mb_body_is_refused_at_once_while_a_small_request_completes(backend):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (20 * MIB)}]}).encode()
    process = psutil.Process()
    with serve(backend) as live:
        assert_still_serving(live.url)  # warm: the first request's one-off costs are not the limit's
        rss_before = process.memory_info().rss
        answers: dict[str, tuple[int, float]] = {}

        def send(name: str, content: bytes) -> None:
            started = time.perf_counter()
            reply = httpx.post(f"{live.url}{CHAT}", content=content, timeout=60,
                               headers={"content-type": "application/json"})
            answers[name] = (reply.status_code, time.perf_counter() - started)
            if name == "huge":
                assert_error(reply, 413, "request_too_large")

        small = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 2}).encode()
        threads = [threading.Thread(target=send, args=("huge", body)),
                   threading.Thread(target=send, args=("small", small))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        rss_after = process.memory_info().rss
    print(f"20 MB body: {answers['huge'][0]} in {answers['huge'][1] * 1e3:.0f} ms; concurrent 2-token request "
          f"{answers['small'][0]} in {answers['small'][1] * 1e3:.0f} ms; server process RSS "
          f"{rss_before / MIB:.0f} -> {rss_after / MIB:.0f} MiB")
    assert answers["huge"][0] == 413 and answers["huge"][1] < 1.0  # the bound; the RSS one shows it unread
    assert answers["small"][0] == 200 and answers["small"][1] < 10.0
    assert rss_after - rss_before < 64 * MIB  # the body was never held (the test's own copy predates `before`)


def test_a_chunked_body_is_cut_off_at_the_limit(backend):
    def chunks():
        yield b'{"model": "aidreams-260k", "prompt": "'
        for _ in range(64):
            yield b"y" * MIB
        yield b'"}'

    with serve(backend, APIConfig(port=0, max_body_bytes=4 * MIB)) as live:
        started = time.perf_counter()
        reply = httpx.post(f"{live.url}{COMPLETIONS}", content=chunks(), timeout=60,
                           headers={"content-type": "application/json"})
        assert_error(reply, 413, "request_too_large")
        assert time.perf_counter() - started < 5
        # Under the limit, a chunked body is read as usual.
        ok = httpx.post(f"{live.url}{COMPLETIONS}", timeout=60, headers={"content-type": "application/json"},
                        content=iter([json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()]))
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path, body", [
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "split emoji \ud83d"}]}),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi", "name": "\ud800"}]}),
    (COMPLETIONS, {"model": MODEL, "prompt": ["fine", "lone \ud800 surrogate"]}),
])
def test_lone_surrogates_are_a_400_json_error(server, path, body):
    # json.dumps writes "\ud83d" escapes, exactly what a JavaScript client sends for a split emoji.
    error = assert_error(post(server.url, path, json.dumps(body)), 400, "bad_request")
    assert "surrogate" in error["message"]
    assert_still_serving(server.url)


def test_a_stop_string_with_a_lone_surrogate_is_refused(server):
    # It could never match what the model writes: refused like one in the prompt, naming the field.
    error = assert_error(post(server.url, COMPLETIONS, json.dumps({"model": MODEL, "prompt": "Hi",
                                                                   "stop": ["end\udc00"]})), 400, "invalid_value")
    assert "surrogate" in error["message"] and error["param"] == "stop"


def test_an_error_quoting_a_surrogate_is_still_json(server):
    # A validation error whose location is a dict key the client chose.
    reply = post(server.url, COMPLETIONS, json.dumps({"model": MODEL, "prompt": "Hi", "logit_bias": {"\ud800": "x"}}))
    assert_error(reply, 400, "invalid_value")
    assert reply.json()["error"]["param"].startswith("logit_bias.")


def test_a_text_too_long_for_any_context_is_refused_before_tokenizing(backend):
    text = "lorem ipsum dolor sit amet " * 200_000  # 5.4 MB: within the body limit, far over the context
    with serve(backend) as live:
        started = time.perf_counter()
        error = assert_error(post(live.url, COMPLETIONS, {"model": MODEL, "prompt": text}), 400,
                             "context_length_exceeded")
        elapsed = time.perf_counter() - started
        assert "characters" in error["message"]
        assert elapsed < 3.0, f"{elapsed:.1f}s: the prompt was tokenized"
        assert_still_serving(live.url)


def test_openapi_lists_what_the_api_answers(backend):
    with serve(backend, APIConfig(port=0, api_key="k")) as live:
        schema = httpx.get(f"{live.url}/openapi.json", headers={"authorization": "Bearer k"}, timeout=10).json()
    paths = schema["paths"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert set(paths[path]["post"]["responses"]) == {"200", "400", "401", "404", "413", "429", "500", "503", "504"}
        assert paths[path]["post"]["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    assert set(paths["/v1/models/{model}"]["get"]["responses"]) == {"200", "401", "404", "500"}
    assert set(paths["/health"]["get"]["responses"]) == {"200", "503"}
    assert "422" not in json.dumps(schema) and "HTTPValidationError" not in schema["components"]["schemas"]
