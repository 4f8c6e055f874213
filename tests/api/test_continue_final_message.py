"""Assistant prefill (vLLM's `continue_final_message`, extra body): the reply goes on from the last
message, an assistant's opening words, instead of starting a new turn. Exactly what a legacy
completion of the rendered chat, cut after those words, generates; on one process and on the
2-stage pipeline of node processes."""

from __future__ import annotations

import openai
import pytest

pytestmark = [pytest.mark.timeout(600)]

OPENING = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Once upon a time "}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def test_the_reply_continues_the_assistants_opening_words(server):
    client, model = server.client(), server.backend.model_id
    reply = client.chat.completions.create(model=model, messages=OPENING, max_tokens=12, temperature=0,
                                           logprobs=True, extra_body=CONTINUE)
    # aidreams renders with the plain template: "user: Hello\nassistant: Once upon a time \n"; the
    # continuation starts where the message's text ends (its trailing space kept, as the template keeps it).
    completion = client.completions.create(model=model, prompt="user: Hello\nassistant: Once upon a time ",
                                           max_tokens=12, temperature=0)
    text = reply.choices[0].message.content
    assert text == completion.choices[0].text and text
    assert b"".join(bytes(e.bytes) for e in reply.choices[0].logprobs.content) == text.encode()
    streamed = client.chat.completions.create(model=model, messages=OPENING, max_tokens=12, temperature=0,
                                              stream=True, extra_body=CONTINUE)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    # Without the flag the same messages are history, and the reply is a new turn.
    new_turn = client.chat.completions.create(model=model, messages=OPENING, max_tokens=12, temperature=0)
    plain = client.completions.create(model=model, prompt="user: Hello\nassistant: Once upon a time \nassistant:",
                                      max_tokens=12, temperature=0)
    assert new_turn.choices[0].message.content == plain.choices[0].text.lstrip(" ")


@pytest.mark.parametrize("messages, extra, says", [
    ([{"role": "user", "content": "Hello"}], {"continue_final_message": True}, "last message to be an assistant"),
    ([*OPENING[:1], {"role": "assistant", "content": "  "}], {"continue_final_message": True}, "assistant's text"),
    (OPENING, {"continue_final_message": True, "add_generation_prompt": True}, "set at most one"),
])
def test_a_prefill_that_cannot_be_continued_is_a_400(server, messages, extra, says):
    with pytest.raises(openai.BadRequestError, match=says):
        server.client().chat.completions.create(model=server.backend.model_id, messages=messages, max_tokens=4,
                                                extra_body=extra)


@pytest.mark.slow
def test_prefill_on_the_real_model(smollm2_fast_server):
    client, model = smollm2_fast_server.client(), smollm2_fast_server.backend.model_id
    opening = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]
    reply = client.chat.completions.create(model=model, messages=opening, max_tokens=8, temperature=0,
                                           extra_body={"continue_final_message": True})
    assert reply.choices[0].message.content.startswith(" Paris"), reply.choices[0].message.content
