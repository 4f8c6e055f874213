"""The OpenAI-compatible routes through the real `openai` client against a live server."""

from __future__ import annotations

import httpx
import pytest

from meshllm.engine.sampler import SamplingParams

from .conftest import MODEL

pytestmark = pytest.mark.timeout(180)


def plain_chat_ids(files, content: str) -> list[int]:
    # aidreams has no chat template: the fallback renders "role: content\n...assistant:",
    # encoded with BOS like any text prompt of this model.
    return files.tokenizer.encode(f"user: {content}\nassistant:")


def test_models_lists_the_served_model(server):
    client = server.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/v1/models/other", timeout=10).status_code == 404


def test_chat_greedy_equals_single_process_generation(server, aidreams_files, reference):
    ids = plain_chat_ids(aidreams_files, "Hello")
    expected = reference(ids, SamplingParams(temperature=0, max_tokens=40))
    reply = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == len(ids) + len(expected.token_ids)


def test_chat_stream_equals_whole_reply(server):
    client = server.client()
    kwargs = dict(model=MODEL, messages=[{"role": "system", "content": "Dream."},
                                         {"role": "user", "content": "Tell me"}], temperature=0,
                  max_completion_tokens=30)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_equals_single_process_generation(server, aidreams_files, reference):
    prompts = ["Once upon a time", "The stars"]
    expected = [reference(aidreams_files.tokenizer.encode(p), SamplingParams(temperature=0, max_tokens=24))
                for p in prompts]
    client = server.client()
    reply = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=24)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in reply.choices] == [e.finish_reason for e in expected]
    assert reply.usage.completion_tokens == sum(len(e.token_ids) for e in expected)

    # Token ids as the prompt give the same completion; so does streaming.
    ids = aidreams_files.tokenizer.encode(prompts[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=24)
    assert by_ids.choices[0].text == expected[0].text
    streamed = client.completions.create(model=MODEL, prompt=prompts[0], temperature=0, max_tokens=24, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected[0].text


def test_default_max_tokens(server, aidreams_files):
    client = server.client()
    # Legacy completions default to 16 tokens, as OpenAI's do.
    reply = client.completions.create(model=MODEL, prompt="Once", temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"
    # Chat without a limit may use the rest of the context (128 tokens).
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.total_tokens == 128 and reply.choices[0].finish_reason == "length"


def test_seeded_n2_is_reproducible_and_matches_single_process(server, aidreams_files, reference):
    client = server.client()
    kwargs = dict(model=MODEL, prompt="The moon", temperature=1.0, top_p=0.95, max_tokens=20, n=2, seed=1234)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices]
    assert texts[0] != texts[1], "choices of one request must get different seeds"
    # Choice j samples with seed + j, exactly as the single-process loop does with that seed.
    ids = aidreams_files.tokenizer.encode("The moon")
    assert texts == [reference(ids, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=1234 + j)).text
                     for j in range(2)]
    other = client.completions.create(**{**kwargs, "seed": 99})
    assert [c.text for c in other.choices] != texts


def test_top_p_0_samples_only_the_likeliest_token(server):
    # OpenAI takes top_p 0 as the smallest nucleus, and clients send it (it was a 400 here): at any
    # temperature and seed the text is then the greedy one.
    client = server.client()
    greedy = client.completions.create(model=MODEL, prompt="The moon", temperature=0, max_tokens=12).choices[0].text
    for seed in (1, 2, 3):
        reply = client.completions.create(model=MODEL, prompt="The moon", temperature=1.5, top_p=0, max_tokens=12,
                                          seed=seed)
        assert reply.choices[0].text == greedy


def test_greedy_n2_gives_identical_choices(server):
    reply = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=12, n=2)
    assert len(reply.choices) == 2 and reply.choices[0].message.content == reply.choices[1].message.content
    assert reply.usage.completion_tokens % 2 == 0 and reply.usage.completion_tokens > 0


def test_stop_string_across_token_boundary(server):
    client = server.client()
    prompt = "Once upon a time"
    # Streamed deltas of a greedy run are one token's text each: they show the token boundaries.
    chunks = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stream=True) if c.choices and c.choices[0].text]
    full = "".join(chunks)
    stop = None
    for i in range(1, len(chunks) - 1):
        left, right = chunks[i], chunks[i + 1]
        if len(left) >= 2 and len(right) >= 2:
            candidate = left[-2:] + right[:2]  # two characters from each side of the boundary
            start = len("".join(chunks[:i + 1])) - 2
            if full.find(candidate) == start:
                stop = candidate
                break
    assert stop is not None, f"no usable token boundary in {chunks!r}"
    expected = full[:full.find(stop)]

    reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stop=[stop])
    assert reply.choices[0].text == expected
    assert reply.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_chat_logprobs(server):
    reply = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], temperature=0, max_tokens=10,
        logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 10
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        # Greedy picks the likeliest token: it heads the alternatives.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    assert "".join(e.token for e in content).strip() == reply.choices[0].message.content.strip()


def test_completion_logprobs_whole_and_streamed(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt="The stars", temperature=0, max_tokens=8, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    assert len(whole.tokens) == len(whole.token_logprobs) == len(whole.top_logprobs) == len(whole.text_offset) == 8
    assert all(len(t) <= 2 for t in whole.top_logprobs)
    assert whole.text_offset == [sum(len(t) for t in whole.tokens[:i]) for i in range(8)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.text_offset
    assert [x for lp in streamed for x in lp.token_logprobs] == pytest.approx(whole.token_logprobs)


def test_text_content_parts_and_health(server):
    reply = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                                            {"type": "text", "text": "lo"}]}],
        temperature=0, max_tokens=6)
    same = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], temperature=0, max_tokens=6)
    assert reply.choices[0].message.content == same.choices[0].message.content
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["reason"] is None
    assert httpx.head(f"{server.url}/health", timeout=10).status_code == 200


def test_null_fields_mean_their_defaults(server):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": None, "temperature": None, "n": None, "stream": None,
            "logprobs": None, "stop": None, "seed": None, "top_k": -1, "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 16
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi", "name": None}], "logprobs": None,
            "max_completion_tokens": 3, "stream_options": None, "tools": None}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30).status_code == 200


def test_repeated_prompt_reports_cached_tokens(server, aidreams_files):
    prompt = "Echoes of vectors unfold, a gentle hum of precision, as I settle into a tapestry of light and numbers"
    num_prompt_tokens = len(aidreams_files.tokenizer.encode(prompt))
    assert num_prompt_tokens > 32  # at least one whole prefix-cache block (32 tokens)
    client = server.client()
    hits_before = server.metric("meshllm_prefix_cache_hit_tokens_total")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == num_prompt_tokens
    assert 32 <= cached < num_prompt_tokens and cached % 32 == 0
    assert server.metric("meshllm_prefix_cache_hit_tokens_total") - hits_before == cached
    assert second.choices[0].text == first.choices[0].text
