"""The Responses API's parts without a server: input items to chat messages, deltas to output
items and stream events, and the bounded store of responses."""

from __future__ import annotations

import pytest

from meshllm.api.choices import ChoiceState
from meshllm.api.prompts import ChoiceRequest
from meshllm.api.responses_api.output import OutputItems, as_chat_message
from meshllm.api.responses_api.reply import ResponseRun
from meshllm.api.responses_api.requests import ResponsesRequest, chat_messages, chat_request, input_items
from meshllm.api.responses_api.store import ResponseStore, input_items_page
from meshllm.api.tool_parser import CallDelta
from meshllm.engine.sampler import SamplingParams
from meshllm.errors import BadRequest, MeshError, NotFound

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_input_items_become_the_chat_messages_they_stand_for():
    body = request(input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        # What a client sends back of an earlier reply: a message with its id and status, then its calls.
        {"type": "message", "id": "msg-1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc-1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "20 C"}]},
    ])
    assert chat_messages(body) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "20 C"},
    ]
    # A call with no assistant message before it opens one of its own.
    calls_only = chat_messages(request(input=[{"role": "user", "content": "x"}, {
        "type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"}]))
    assert calls_only[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}


def test_the_request_becomes_the_chat_request_it_amounts_to():
    body = request(instructions="Be brief.", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                   parallel_tool_calls=False, max_output_tokens=30, temperature=0.5, top_p=0.9, seed=7,
                   include=["message.output_text.logprobs"], top_logprobs=2,
                   text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}})
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}]
    chat = chat_request(body, history, chat_messages(body))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert chat.messages[0].content == "Be brief." and chat.messages[-1].content == "hi"
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.strict is True
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls is False
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.name == "w"
    assert (chat.completion_limit, chat.temperature, chat.top_p, chat.seed) == (30, 0.5, 0.9, 7)
    assert chat.num_logprobs == 2
    plain = chat_request(request(), [], chat_messages(request()))
    assert plain.response_format is None and plain.num_logprobs is None and plain.tools is None


@pytest.mark.parametrize("fields, says", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "read text only"),
    ({"input": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id must be a string"),
    ({"input": [{"type": "computer_call", "id": "c"}]}, "'computer_call' are not supported"),
    ({"input": [{"type": "item_reference", "id": "msg-1"}]}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format type 'grammar'"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}]}, "its text as a string"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "not among tools"),
    ({"tools": [{**WEATHER, "name": "bad name!"}]}, "tools.0.function.name"),
])
def test_what_cannot_be_served_is_refused_with_the_reason(fields, says):
    body = request(**fields)
    with pytest.raises(BadRequest) as refused:
        chat_request(body, [], chat_messages(body))
    assert says in str(refused.value)


@pytest.mark.parametrize("fields, says", [
    ({"background": True}, "background"), ({"conversation": "conv_1"}, "conversation"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "16 keys"), ({"metadata": {"k": "v" * 513}}, "512"),
    ({"max_tokens": 5}, "use max_output_tokens"), ({"messages": []}, "send them as input"),
    ({"response_format": {"type": "json_object"}}, "use text.format"), ({"prompt": {"id": "p"}}, "prompt"),
    ({"metadata": {"k": "\ud800"}}, "metadata.k is not valid Unicode"),
    ({"user": "\udfff"}, "user is not valid Unicode"), ({"text": {"format": "json"}}, "text.format must be an object"),
    ({"input": []}, "input is empty"), ({"input": ""}, "input is empty"),
])
def test_what_would_be_lost_fails_validation(fields, says):
    with pytest.raises(ValueError, match=says):
        request(**fields)


def test_what_changes_nothing_here_is_accepted():
    # truncation "auto" drops nothing here either (an overflowing input is a 400 as with "disabled");
    # tool_choice "auto" without tools is what agent frameworks send for an agent with none.
    body = request(truncation="auto", tool_choice="auto", tools=[], reasoning={"effort": "low"},
                   text={"verbosity": "low"}, prompt_cache_key="k")
    chat = chat_request(body, [], chat_messages(body))
    assert chat.tools is None and chat.tool_choice is None and chat.response_format is None


def test_a_function_output_must_answer_a_call_made_before_it():
    lone = request(input=[{"role": "user", "content": "x"},
                          {"type": "function_call_output", "call_id": "call_9", "output": "18 C"}])
    with pytest.raises(BadRequest, match="no function call with call_id 'call_9'"):
        chat_messages(lone)
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert chat_messages(lone, history)[-1] == {"role": "tool", "tool_call_id": "call_9", "content": "18 C"}


def _types(events: list[dict]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def test_deltas_become_items_and_the_events_that_build_them():
    out = OutputItems()
    events = out.feed("\n", [], [])  # whitespace alone opens nothing yet
    assert events == [] and out.items == []
    events = out.feed("Hi", [], [{"token": "Hi"}])
    assert _types(events) == ["output_item.added", "content_part.added", "output_text.delta"]
    assert events[-1]["delta"] == "\nHi" and events[-1]["logprobs"] == [{"token": "Hi"}]
    events = out.feed(" ", [CallDelta(0, "call_1", "get_weather", '{"ci')], [])
    # The open message takes the space (as a chat reply's content does); it closes as the call opens.
    assert _types(events) == ["output_text.delta", "output_text.done", "content_part.done", "output_item.done",
                              "output_item.added", "function_call_arguments.delta"]
    assert events[3]["item"]["status"] == "completed" and events[3]["item"]["content"][0]["text"] == "\nHi "
    assert events[4]["item"] == {"type": "function_call", "id": events[4]["item"]["id"], "call_id": "call_1",
                                 "name": "get_weather", "arguments": "", "status": "in_progress"}
    out.feed("", [CallDelta(0, arguments='ty": "Paris"}')], [])
    events = out.finish("incomplete", whole_calls=frozenset({"call_1"}))
    assert _types(events) == ["function_call_arguments.done", "output_item.done"]
    assert events[0]["arguments"] == '{"city": "Paris"}' and events[1]["item"]["status"] == "completed"
    assert [i["type"] for i in out.items] == ["message", "function_call"]
    assert [e["output_index"] for e in events] == [1, 1]
    assert as_chat_message(out.items) == {"role": "assistant", "content": "\nHi ", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


def test_a_reply_cut_short_leaves_its_open_item_incomplete():
    out = OutputItems()
    out.feed("", [CallDelta(0, "call_1", "f", "{}")], [])
    out.feed("\n ", [], [])  # after a call, whitespace alone opens no message
    out.feed("Once upon", [], [])
    events = out.finish("incomplete")
    assert events[-1]["item"]["status"] == "incomplete" and as_chat_message(out.items)["content"] == "\n Once upon"
    assert [i["status"] for i in out.items] == ["completed", "incomplete"]
    assert as_chat_message(OutputItems().items) is None


def test_the_store_keeps_the_most_recently_used_within_its_count_and_size():
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(5):
        store.put({"id": f"r{i}"}, None, [{"role": "user", "content": "x" * 10}])
    assert len(store) == 3
    with pytest.raises(NotFound, match="not stored here"):
        store.get("r1")
    store.get("r2")  # read: now the newest
    store.put({"id": "r5"}, None, [])
    assert store.get("r2") and store.get("r5")
    with pytest.raises(NotFound):
        store.get("r3")
    store.put({"id": "big"}, None, [{"role": "user", "content": "x" * 9_950}])  # the others must go to fit it
    assert len(store) == 1 and store.get("big")
    store.put({"id": "huge"}, None, [{"role": "user", "content": "x" * 20_000}])  # larger than the store: not kept
    with pytest.raises(NotFound):
        store.get("huge")
    store.delete("big")
    with pytest.raises(NotFound):
        store.delete("big")


def test_a_conversation_is_its_responses_followed_back_each_counted_once():
    store = ResponseStore(max_responses=5, max_bytes=100_000)
    turn = lambda i: [{"role": "user", "content": f"q{i} " + "x" * 1000}, {"role": "assistant", "content": f"a{i}"}]  # noqa: E731
    store.put({"id": "old"}, None, [])
    store.put({"id": "t0"}, None, turn(0))
    for i in range(1, 4):
        store.put({"id": f"t{i}"}, f"t{i - 1}", turn(i))
    assert store.conversation("t3") == turn(0) + turn(1) + turn(2) + turn(3)
    assert store._bytes < 4 * 1200  # each turn's text once, not the whole conversation again per turn
    store.put({"id": "other"}, None, [])  # the least recently used goes: "old", not t0, which the read refreshed
    assert store.conversation("t3")[0] == turn(0)[0]
    with pytest.raises(NotFound):
        store.get("old")
    store.delete("t1")
    with pytest.raises(NotFound, match="continues 't1', which is no longer stored"):
        store.conversation("t3")


def test_logprobs_go_with_the_text_their_tokens_wrote():
    out = OutputItems()
    entry = lambda text: {"token": text, "bytes": list(text.encode())}  # noqa: E731
    out.feed("", [], [entry("<tool_call>")])  # markup the parser holds: no text yet
    out.feed("", [CallDelta(0, "call_1", "f", '{"a": 1}')], [entry('{"a": 1}')])
    out.feed("", [], [entry("</tool_call>")])  # markup again
    out.feed("\n\n", [], [entry("\n\n")])  # held: whitespace after a call
    events = out.feed("Done", [], [entry("Done")])
    assert [e["token"] for e in events[-1]["logprobs"]] == ["\n\n", "Done"]
    out.feed("", [], [{"token": "<eos>", "bytes": []}])
    done = out.finish("completed")
    part = done[-1]["item"]["content"][0]
    assert b"".join(bytes(e["bytes"]) for e in part["logprobs"]) == part["text"].encode() == b"\n\nDone"


def test_input_items_are_listed_as_openai_pages_them():
    items = input_items(request(input=[{"role": "user", "content": "hi"},
                                       {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                       {"type": "function_call_output", "call_id": "c", "output": "1", "id": "own"}]))
    assert items[0]["content"] == [{"type": "input_text", "text": "hi"}] and items[0]["id"].startswith("msg_")
    assert items[1]["id"].startswith("fc_") and items[2]["id"] == "own"
    assert input_items(request(input="hi"))[0]["role"] == "user"
    page = input_items_page(items, 2, "desc", None, None)  # newest first, OpenAI's default
    assert [i["id"] for i in page["data"]] == ["own", items[1]["id"]] and page["has_more"]
    rest = input_items_page(items, 2, "desc", page["last_id"], None)
    assert [i["id"] for i in rest["data"]] == [items[0]["id"]] and not rest["has_more"]
    assert [i["id"] for i in input_items_page(items, 20, "asc", None, "own")["data"]] == [items[0]["id"], items[1]["id"]]
    with pytest.raises(BadRequest, match="not among"):
        input_items_page(items, 20, "asc", "nope", None)
    with pytest.raises(BadRequest, match="limit"):
        input_items_page(items, 0, "asc", None, None)


def test_errors_from_the_chat_machinery_name_this_apis_fields():
    from meshllm.api.responses_api.requests import in_responses_terms
    from meshllm.errors import ContextOverflow, ShardUnavailable

    renamed = in_responses_terms(ContextOverflow("prompt of 5 tokens + max_tokens 500 = 505 exceeds; lower max_tokens"))
    assert isinstance(renamed, ContextOverflow) and str(renamed) == \
        "prompt of 5 tokens + max_output_tokens 500 = 505 exceeds; lower max_output_tokens"
    assert str(in_responses_terms(BadRequest("invalid request: tools.0.function.name: bad"))) == \
        "invalid request: tools.0.name: bad"
    assert "message 1 of the conversation" in str(in_responses_terms(BadRequest("messages[1].content is long")))
    assert str(in_responses_terms(BadRequest("response_format json_schema 'x': bad"))) == "text.format json_schema 'x': bad"
    plain = BadRequest("nothing to rename")
    assert in_responses_terms(plain) is plain
    richer = ShardUnavailable("max_tokens", missing_bytes=1, part="x")  # carries more than its message: kept
    assert in_responses_terms(richer) is richer


def test_a_failed_response_leaves_the_item_it_cut_short_incomplete():
    run = ResponseRun(request(), ChoiceState(ChoiceRequest(0, 0, [1, 2], SamplingParams())), [], None, "m")
    run.output.feed("Once upon", [], [])
    failed = run.response(error=MeshError("the stage went away"))
    assert failed["status"] == "failed" and [item["status"] for item in failed["output"]] == ["incomplete"]
    assert "the stage went away" in failed["error"]["message"]


def test_reasoning_becomes_a_reasoning_item_and_goes_back_with_the_turn():
    # GPT-OSS's analysis channel (api/harmony.py): a reasoning item with one reasoning_text part,
    # streamed as response.reasoning_text.delta, closed when the call opens
    out = OutputItems()
    events = out.feed("", [], [{"token": "We"}], reasoning="We need")
    assert _types(events) == ["output_item.added", "reasoning_text.delta"]
    assert events[0]["item"]["type"] == "reasoning" and events[1]["delta"] == "We need"
    out.feed("", [], [], reasoning=" the weather.")
    events = out.feed("", [CallDelta(0, "call_1", "get_weather", "{}")], [])
    assert _types(events)[:3] == ["reasoning_text.done", "output_item.done", "output_item.added"]
    assert events[0]["text"] == "We need the weather." and events[1]["item"]["status"] == "completed"
    out.finish("completed")
    message = as_chat_message(out.items)
    assert message["reasoning_content"] == "We need the weather." and message["tool_calls"][0]["id"] == "call_1"
    # sent back as input items, the reasoning reaches the assistant turn it led to
    body = request(input=[{"role": "user", "content": "Weather in Paris?"}, *out.items,
                          {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}])
    assert chat_messages(body)[1] == {"role": "assistant", "content": None, "reasoning_content": "We need the weather.",
                                      "tool_calls": [{"id": "call_1", "type": "function",
                                                      "function": {"name": "get_weather", "arguments": "{}"}}]}
