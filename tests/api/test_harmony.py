"""GPT-OSS's harmony replies read into reasoning, content and tool calls (api/harmony.py), fed
whole and token by token as they stream, and what a chat reply and its stream chunks then carry.

The readers are fed events as the leader emits them (a marker token's id with no text; other
text in pieces): no model runs here. tests/api/test_tool_calling.py serves a tiny random
GPT-OSS whose template speaks harmony through real HTTP, its calls and JSON answers grammar-
constrained."""

from __future__ import annotations

import json

import pytest

from meshllm.api.choices import ChoiceState
from meshllm.api.harmony import MARKERS, HarmonyReader, HarmonyTokens
from meshllm.api.prompts import ChoiceRequest
from meshllm.api.replies import ReplyContext, assistant_message
from meshllm.api.streaming import _ChatChunks
from meshllm.api.tool_formats import ToolFormat
from meshllm.engine.grammar import GrammarCompiler
from meshllm.engine.sampler import SamplingParams
from meshllm.model.tokenizer import Tokenizer
from meshllm.pipeline.events import GenerationEvent
from tests.api.tool_families import tiny_family_model

TOKENS = HarmonyTokens({m: 100 + i for i, m in enumerate(MARKERS)})
ID = TOKENS.ids


def _pieces(reply: str, chop: int) -> list[tuple[str, int | None]]:
    """The reply as events: markers as their token ids, the text between in `chop`-character pieces."""
    out, text = [], reply
    while text:
        marker = next((m for m in MARKERS if text.startswith(m)), None)
        if marker is not None:
            out.append(("", ID[marker]))
            text = text[len(marker):]
            continue
        end = min([i for i in (text.find(m) for m in MARKERS) if i > 0] + [len(text)])
        out += [(text[i:min(i + chop, end)], None) for i in range(0, end, chop)]
        text = text[end:]
    return out


def _read(reply: str, chop: int, parallel: bool = True):
    reader = HarmonyReader(TOKENS, lambda: f"call_{len(reader.calls)}", parallel)
    content, reasoning, deltas = "", "", []
    for text, token_id in _pieces(reply, chop):
        c, d = reader.feed(text, token_id)
        content, reasoning, deltas = content + c, reasoning + reader.reasoning_delta, deltas + d
    content += reader.finish()
    return reader, content, reasoning, deltas


CALL = ('<|channel|>analysis<|message|>User wants weather; call the tool.<|end|><|start|>assistant'
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
CASES = [
    # reasoning, then the answer
    ("<|channel|>analysis<|message|>2 + 2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
     "It is 4.", "2 + 2 is 4.", []),
    (CALL, "", "User wants weather; call the tool.", [("get_weather", {"city": "Paris"})]),
    # the recipient after the role, as the template writes earlier calls
    ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>', "", "",
     [("get_time", {"zone": "UTC"})]),
    # a preamble to the user on commentary, then a call
    ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.a '
     '<|constrain|>json<|message|>{}<|call|>', "Checking.", "", [("a", {})]),
    # a built-in tool of OpenAI's is not the client's: neither content nor a call
    ('<|channel|>analysis<|message|>search<|end|><|start|>assistant<|channel|>analysis to=browser.search '
     'code<|message|>{"q": 1}<|call|>', "", "search", []),
    # a model that ignores the format: its text is the content, ended by a stop token or not
    ("Just text, no markers.", "Just text, no markers.", "", []),
    ("Just text, then the stop token.<|return|>", "Just text, then the stop token.", "", []),
]


@pytest.mark.parametrize("reply, content, reasoning, calls", CASES)
@pytest.mark.parametrize("chop", [1000, 1, 3])
def test_a_reply_reads_the_same_whole_and_streamed(reply, content, reasoning, calls, chop):
    reader, streamed, streamed_reasoning, deltas = _read(reply, chop)
    assert (streamed, reader.text) == (content, content)
    assert (streamed_reasoning, "".join(reader.reasoning)) == (reasoning, reasoning)
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == calls
    assert all(c.complete for c in reader.calls)
    for i, call in enumerate(reader.calls):  # the deltas of each call: its id and name once, then its arguments
        mine = [d for d in deltas if d.index == i]
        assert (mine[0].id, mine[0].name) == (call.id, call.name)
        assert "".join(d.arguments for d in mine) == call.arguments


def test_one_call_when_parallel_calls_are_off():
    twice = CALL.replace("<|call|>", "<|end|><|start|>assistant<|channel|>commentary to=functions.b "
                                     "<|constrain|>json<|message|>{}<|call|>")
    assert [c.name for c in _read(twice, 4)[0].calls] == ["get_weather", "b"]
    assert [c.name for c in _read(twice, 4, parallel=False)[0].calls] == ["get_weather"]


def test_a_cut_reply_keeps_what_it_had():
    reader, content, reasoning, _ = _read("<|channel|>analysis<|message|>still thinking", 5)
    assert (content, reasoning) == ("", "still thinking")
    reader = HarmonyReader(TOKENS, lambda: "call_x")
    for text, token_id in _pieces("<|channel|>fin", 2):
        assert reader.feed(text, token_id) == ("", [])
    assert reader.finish(cut=True) == "" and reader.text == ""  # a header cut short is no content
    reader = HarmonyReader(TOKENS, lambda: "call_x")
    assert reader.feed("cut plain text") == ("", []) and reader.finish(cut=True) == "cut plain text"


def test_text_released_with_a_marker_comes_before_it():
    # the leader holds text back (a stop string's prefix, part of a character) and releases it
    # with the next token's event, which may be the marker that closes the message
    reader = HarmonyReader(TOKENS, lambda: "call_x")
    reader.feed("", ID["<|channel|>"])
    reader.feed("final", None)
    reader.feed("", ID["<|message|>"])
    assert reader.feed("It is", None) == ("It is", [])
    assert reader.feed(" 4.", ID["<|return|>"]) == (" 4.", [])
    assert reader.text == "It is 4."


def test_without_tools_a_call_message_is_content_and_a_continued_final_goes_on():
    reader, content, _, _ = _read(CALL, 3)
    assert reader.calls and content == ""
    plain = HarmonyReader(TOKENS, lambda: "call_x", calls_tools=False)
    for text, token_id in _pieces(CALL, 3):
        plain.feed(text, token_id)
    assert not plain.calls and plain.text == '{"city": "Paris"}'
    # continue_final_message: the prompt ends inside the final message
    going_on = HarmonyReader(TOKENS, lambda: "call_x", in_final=True)
    assert going_on.feed(" and more", None) == (" and more", [])
    assert going_on.feed("", ID["<|return|>"]) == ("", []) and going_on.finish() == ""
    assert going_on.text == " and more"


def _state(reply: str) -> tuple[ChoiceState, list]:
    state = ChoiceState(ChoiceRequest(0, 0, [1], SamplingParams()), HarmonyReader(TOKENS, lambda: "call_x"))
    ctx = ReplyContext.new("chatcmpl", "m", None, False)
    chunks, out = _ChatChunks(ctx), []
    pieces = _pieces(reply, 3)
    for n, (text, token_id) in enumerate(pieces):
        event = GenerationEvent(seq_id=0, text=text, token_id=token_id if token_id is not None else 7,
                                finish_reason="stop" if n == len(pieces) - 1 else None)
        assert state.add(event) is None
        content, calls = state.delta
        if content or calls or state.reasoning_delta:
            out.append(json.loads(chunks.delta(state, event).model_dump_json())["choices"][0]["delta"])
    return state, out


def test_the_reply_and_its_chunks_carry_reasoning_content_apart():
    state, chunks = _state(CASES[0][0])
    message = json.loads(assistant_message(state).model_dump_json())
    assert message == {"role": "assistant", "content": "It is 4.", "tool_calls": None,
                       "reasoning_content": "2 + 2 is 4."}
    assert "".join(c.get("reasoning_content") or "" for c in chunks) == "2 + 2 is 4."
    assert "".join(c.get("content") or "" for c in chunks) == "It is 4."
    # a model without reasoning keeps OpenAI's shape: no reasoning_content key at all
    plain, plain_chunks = _state("Just text.")
    assert "reasoning_content" not in json.loads(assistant_message(plain).model_dump_json())
    assert all("reasoning_content" not in c for c in plain_chunks)


def test_a_call_reply_finishes_as_tool_calls():
    state, _ = _state(CALL)
    assert state.finish_reason == "tool_calls"
    message = assistant_message(state)
    assert message.content is None and message.tool_calls[0].function.name == "get_weather"
    assert message.reasoning_content == "User wants weather; call the tool."


SCHEMA = {"type": "object", "properties": {"celsius": {"type": "integer"}}, "required": ["celsius"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
THINK = "<|channel|>analysis<|message|>Hot day, say 30.<|end|><|start|>assistant"


@pytest.mark.parametrize("kind, reply, allowed", [
    ("answer", THINK + '<|channel|>final<|message|>{"celsius": 30}', True),
    ("answer", '<|channel|>final<|message|>{"celsius": 30}', True),  # reasoning is optional
    ("answer", '<|channel|>final<|message|>{"celsius": "30"}', False),
    ("answer", '{"celsius": 30}', False),  # the document alone, without its message
    ("call", THINK + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}', True),
    ("call", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"town": "Oslo"}', False),
    ("call", '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}', False),
    ("call", '<|channel|>final<|message|>Oslo is sunny.', False),
    ("text_or_call", '<|channel|>final<|message|>Oslo is sunny.', True),
    ("text_or_call", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": 1}', False),
])
def test_grammars_let_a_reply_reason_first_then_hold_it_to_the_schema(tiny_model_dir, kind, reply, allowed):
    tokenizer = Tokenizer.from_folder(tiny_family_model(tiny_model_dir, "harmony", seed=31))
    fmt = ToolFormat.of(tokenizer)
    assert fmt.family == "harmony"
    text = {"answer": lambda: fmt.answer_grammar(SCHEMA), "call": lambda: fmt.call_grammar([WEATHER], True),
            "text_or_call": lambda: fmt.text_or_call_grammar([WEATHER], True)}[kind]()
    compiler = GrammarCompiler(tokenizer)
    matcher = compiler.matcher(compiler.lark(text, kind))
    ids = tokenizer.encode(reply, add_special_tokens=False)
    consumed = all(matcher.accept(i) for i in ids)
    assert (consumed and matcher.is_accepting) == allowed


def test_an_assistant_messages_reasoning_goes_back_to_the_template():
    # GPT-OSS's template writes an earlier call's reasoning (message.thinking) before the call;
    # Qwen3's reads message.reasoning_content: both names carry what a reply's reasoning_content was
    from meshllm.api.schemas import ChatMessage

    message = ChatMessage(role="assistant", content="", reasoning_content="Call the tool.",
                          tool_calls=[{"id": "call_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": "{}"}}])
    rendered = message.as_template_input()
    assert rendered["thinking"] == rendered["reasoning_content"] == "Call the tool."
    assert "thinking" not in ChatMessage(role="assistant", content="Hi").as_template_input()
