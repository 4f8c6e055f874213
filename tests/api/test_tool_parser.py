"""Tool calls parsed out of model output per template family, whole and fed in every chunking
(streaming): same content, same calls, argument deltas that join to the final arguments."""

from __future__ import annotations

import json
import random

import pytest

from meshllm.api.tool_formats import ToolFormat
from meshllm.api.tool_parser import ToolCallParser

HERMES = ToolFormat("hermes", True, "<tool_call>", None, "arguments", '"<tool_call>"', '"</tool_call>"')
LLAMA3 = ToolFormat("llama3", True, None, None, "parameters")
MISTRAL = ToolFormat("mistral", True, "[TOOL_CALLS]", None, "arguments", '"[TOOL_CALLS]"')
MISTRAL_SPECIAL = ToolFormat("mistral", True, "[TOOL_CALLS]", 7, "arguments", "<[7]>")

W = {"city": "Paris", "note": "a \"quoted\" {brace} and \\ back"}
CASES = [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(W) + '}\n</tool_call>',
     "Let me check.\n", [("get_weather", W)]),
    (HERMES, '<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": 2}]}}\n</tool_call>\n'
             '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>', "", [("a", {"x": [1, {"y": 2}]}), ("b", {})]),
    (HERMES, "No tools needed: 3 < 4 and <tool is not a tag.", "No tools needed: 3 < 4 and <tool is not a tag.", []),
    (LLAMA3, '{"name": "get_weather", "parameters": ' + json.dumps(W) + "}", "", [("get_weather", W)]),
    (LLAMA3, 'The answer is {"not": "a call"}.', 'The answer is {"not": "a call"}.', []),
    (LLAMA3, '{"answer": 42}', '{"answer": 42}', []),
    (MISTRAL, '[TOOL_CALLS][{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {"r": 1}}]', "",
     [("a", {"q": "x"}), ("b", {"r": 1})]),
    (MISTRAL, "Plain [answer] here.", "Plain [answer] here.", []),
]


def _run(fmt: ToolFormat, pieces: list[tuple[str, int | None]], parallel: bool = True):
    parser = ToolCallParser(fmt, parallel)
    streamed, deltas = "", []
    for text, token_id in pieces:
        content, new = parser.feed(text, token_id)
        streamed += content
        deltas += new
    streamed += parser.finish()
    return parser, streamed, deltas


def _chunkings(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize("fmt, output, content, calls", CASES)
def test_calls_and_content_whatever_the_chunking(fmt, output, content, calls):
    for chunks in _chunkings(output, seed=len(output)):
        parser, streamed, deltas = _run(fmt, [(c, None) for c in chunks])
        assert streamed == parser.text == content, chunks
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls, chunks
        assert all(c.arguments == c.arguments.strip() for c in parser.calls)
        assert all(c.complete for c in parser.calls)
        for index, call in enumerate(parser.calls):
            mine = [d for d in deltas if d.index == index]
            assert mine[0].id == call.id and mine[0].name == call.name and mine[0].arguments == ""
            assert all(d.id is None for d in mine[1:])
            assert "".join(d.arguments for d in mine) == call.arguments


def test_special_opening_token_is_seen_by_id_not_text():
    # decoding skips [TOOL_CALLS] when it is a special token: its event has no text
    parser, streamed, _ = _run(MISTRAL_SPECIAL, [("", 7), ('[{"name": "f", "arguments": ', None),
                                                 ('{"a": 1}}]', None)])
    assert streamed == "" and [(c.name, c.arguments) for c in parser.calls] == [("f", '{"a": 1}')]


def test_parallel_false_keeps_only_the_first_call():
    output = CASES[1][1]
    parser, _, deltas = _run(HERMES, [(output, None)], parallel=False)
    assert [c.name for c in parser.calls] == ["a"] and {d.index for d in deltas} == {0}


def test_call_ids_are_unique_and_mistral_ids_are_nine_alphanumerics():
    ids = {HERMES.new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("call_") for i in ids)
    assert all(len(i) == 9 and i.isalnum() for i in (MISTRAL.new_call_id() for _ in range(20)))


def test_a_call_name_with_an_invalid_escape_is_taken_as_written():
    # A weak model may write a bad escape or a raw control character in the name: no exception
    # (a 500, or a stream cut off mid-body), the call's name as the model wrote it.
    parser, _, deltas = _run(LLAMA3, [('{"name": "get\\q\tweather", "parameters": {"a": 1}}', None)])
    assert [(c.name, c.arguments) for c in parser.calls] == [("get\\q\tweather", '{"a": 1}')]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("forced", [False, True])
def test_a_reply_cut_inside_a_calls_markup_leaves_no_markup_as_content(forced):
    """Cut at its token limit at every character of a call: before the call's name is complete no
    call and no content (the markup was a call's, never text); after it, the named call with the
    arguments so far. The opening marker's prefix alone is text unless the reply was forced."""
    for end in range(1, len(CALL)):
        parser = ToolCallParser(HERMES, forced=forced)
        content, _ = parser.feed(CALL[:end])
        content += parser.finish(cut=True)
        named = end > CALL.index('{"city')  # the name is known once its arguments value begins
        if end < len("<tool_call>") and not forced:
            assert content == CALL[:end] and not parser.calls, end  # "<tool" may be text
        else:
            assert content == "", (end, content)
            assert [c.name for c in parser.calls] == (["get_weather"] if named else []), end
        if named:
            assert CALL[CALL.index('{"city'):end].startswith(parser.calls[0].arguments)


def test_a_reply_that_ends_inside_a_calls_head_keeps_the_text():
    """Ended by the model (not cut): what it wrote stays visible, as content."""
    parser = ToolCallParser(HERMES, forced=True)
    content, _ = parser.feed('<tool_call>\n{"name": "get_')
    assert content + parser.finish(cut=False) == '{"name": "get_' and not parser.calls
