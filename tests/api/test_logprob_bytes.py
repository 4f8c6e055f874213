"""Logprob `bytes` rebuild the text exactly: emoji and non-Latin replies of SmolLM2 (byte-level
BPE, where one emoji spans several tokens that are not UTF-8 on their own), whole and streamed,
chat and legacy completions; and sentencepiece's dropped leading space on aidreams."""

from __future__ import annotations

import re

import pytest

from .conftest import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPEAT = [{"role": "user", "content": "Repeat exactly: 🎉🦀 こんにちは 世界 🌍"}]


def _assert_rebuilds(text: str, joined: bytes, finish_reason: str) -> None:
    data = text.encode()
    if finish_reason == "length" and joined != data:
        # Cut mid-character by max_tokens: the text cannot hold the incomplete tail.
        tail = joined[len(data):]
        assert joined.startswith(data) and 0 < len(tail) < 4, (joined, data)
        with pytest.raises(UnicodeDecodeError):
            tail.decode()
        return
    assert joined == data


def test_chat_logprob_bytes_rebuild_emoji_and_non_latin_text(smollm2_fast_server):
    client = smollm2_fast_server.client()
    model = smollm2_fast_server.backend.model_id
    reply = client.chat.completions.create(model=model, messages=REPEAT, temperature=0, max_tokens=24,
                                           logprobs=True, top_logprobs=2)
    text = reply.choices[0].message.content
    assert "🦀" in text and "こんにちは" in text, text
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    partial = [e for e in content if e.bytes and not _utf8(bytes(e.bytes))]
    assert partial, "an emoji reply should hold tokens that are part of a character"
    for e in partial:  # shown escaped, as OpenAI shows them
        assert "\\x" in e.token and "\ufffd" not in e.token
    _assert_rebuilds(text, b"".join(bytes(e.bytes) for e in content), reply.choices[0].finish_reason)
    for e in content:
        if e.top_logprobs[0].logprob == pytest.approx(e.logprob):
            assert e.top_logprobs[0].bytes == e.bytes

    chunks = list(client.chat.completions.create(model=model, messages=REPEAT, temperature=0, max_tokens=24,
                                                 logprobs=True, stream=True))
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed_text == text
    assert [e.bytes for e in entries] == [e.bytes for e in content]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    _assert_rebuilds(streamed_text, b"".join(bytes(e.bytes) for e in entries), finish[0])


def test_completion_tokens_rebuild_the_text(smollm2_fast_server):
    client = smollm2_fast_server.client()
    kwargs = dict(model=smollm2_fast_server.backend.model_id, prompt="🎉🦀🎉🦀 日本語 🎉🦀🎉🦀 日本語 🎉🦀",
                  temperature=0, max_tokens=16, logprobs=1)
    whole = client.completions.create(**kwargs).choices[0]
    assert any("\\x" in t for t in whole.logprobs.tokens), whole.logprobs.tokens
    _assert_rebuilds(whole.text, b"".join(_unescape(t) for t in whole.logprobs.tokens), whole.finish_reason)
    # text_offset counts whole characters of the text before each token
    assert whole.logprobs.text_offset[0] == 0
    assert whole.logprobs.text_offset == sorted(whole.logprobs.text_offset)
    assert whole.logprobs.text_offset[-1] <= len(whole.text)
    streamed = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == whole.logprobs.tokens
    assert [o for c in streamed if c.logprobs for o in c.logprobs.text_offset] == whole.logprobs.text_offset


def test_sentencepiece_leading_space_is_not_in_the_bytes(server):
    # aidreams decodes like Llama 2: the space sentencepiece puts before the first word is dropped.
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once upon"}],
                                           temperature=0, max_tokens=12, logprobs=True)
    content = reply.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes) for e in content)
    _assert_rebuilds(reply.choices[0].message.content, joined, reply.choices[0].finish_reason)
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once upon"}],
                                            temperature=0, max_tokens=12, logprobs=True, stream=True)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert b"".join(bytes(e.bytes) for e in entries) == joined


def test_a_legacy_completion_keeps_the_space_before_its_first_word(server, aidreams_path):
    # Its text continues the prompt's, as OpenAI and vLLM give it: prompt + text reads "Once upon a
    # time, pixel", where a sentencepiece decode of the completion alone gave "Once upon a time,pixel".
    from meshllm.model.source import open_model

    tokenizer = open_model(aidreams_path).tokenizer
    client = server.client()
    kwargs = dict(model=MODEL, prompt="Once upon a time,", temperature=0, max_tokens=8, logprobs=1)
    choice = client.completions.create(**kwargs).choices[0]
    assert choice.text.startswith(" ") and choice.logprobs.tokens[0].startswith(" "), choice  # "▁p"
    prompt_ids = tokenizer.encode("Once upon a time,")
    generated = [tokenizer.backend.token_to_id(t.replace(" ", "\u2581")) for t in choice.logprobs.tokens]
    assert None not in generated, choice.logprobs.tokens
    assert "Once upon a time," + choice.text == tokenizer.decode(prompt_ids + generated)  # exactly what follows
    assert b"".join(t.encode() for t in choice.logprobs.tokens) == choice.text.encode()
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset[1] == len(choice.logprobs.tokens[0])
    streamed = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.text for c in streamed) == choice.text
    # A chat reply starts a text of its own: no space before its first word.
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once upon"}],
                                           temperature=0, max_tokens=8)
    assert not reply.choices[0].message.content.startswith(" ")


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _unescape(token: str) -> bytes:
    """Undo `\\xNN` escapes of bytes that are part of a character (the prompt holds no backslash)."""
    return b"".join(bytes([int(part[2:], 16)]) if part.startswith("\\x") else part.encode()
                    for part in re.split(r"(\\x[0-9a-f]{2})", token) if part)


def test_logprobs_stop_where_a_stop_string_cuts_the_text(smollm2_fast_server):
    """The tokens that wrote a stop string report no logprobs (their text is no part of the reply):
    chat and legacy, whole and streamed, with the stop string spread over several tokens."""
    client = smollm2_fast_server.client()
    model = smollm2_fast_server.backend.model_id
    ask = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    free = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=60).choices[0]
    stop = "10. 10"  # SmolLM2 answers "1. 1\n2. 2\n...": several tokens, digits one by one
    assert stop in free.message.content, free.message.content
    reply = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=60, logprobs=True,
                                           stop=[stop])
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and text == free.message.content.split(stop)[0]
    content = reply.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in content) == text.encode()
    assert len(content) < reply.usage.completion_tokens  # the stop string's tokens were generated
    chunks = [c for c in client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=60,
                                                        logprobs=True, stop=[stop], stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert [e.bytes for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content] == \
        [e.bytes for e in content]

    legacy = client.completions.create(model=model, prompt="1, 2, 3, 4, 5, 6, 7,", temperature=0, max_tokens=30,
                                       logprobs=1, stop=["10, 11"]).choices[0]
    assert legacy.finish_reason == "stop" and legacy.text.endswith("9, "), legacy.text
    assert "".join(legacy.logprobs.tokens) == legacy.text
    assert all(offset < len(legacy.text) for offset in legacy.logprobs.text_offset)
