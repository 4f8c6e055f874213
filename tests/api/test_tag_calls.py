"""Tool calls written with tags (api/tag_calls.py), GLM-4.5's, Qwen3-Coder's and MiniMax-M2's: read
whole and in every chunking, cut anywhere."""

from __future__ import annotations

import json

import pytest

from meshllm.api.tag_calls import GLM, MINIMAX, QWEN3_CODER, TagCallReader
from tests.api.test_tool_parser import _chunkings

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]},
    "tags": {"type": "array", "items": {"type": "string"}}}}}},
    {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}}}}}]


def call(name: str, *pairs: tuple[str, str], newlines: bool = True, form=GLM) -> str:
    """A call as the form's templates write one (GLM-4.7: no newlines between tags; MiniMax-M2: a
    block of its own)."""
    if form is MINIMAX:
        return minimax_block((name, pairs))
    if form is QWEN3_CODER:
        return f"<tool_call>\n<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n"
                                                            for k, v in pairs) + "</function>\n</tool_call>"
    n = "\n" if newlines else ""
    return f"<tool_call>{name}{n}" + "".join(f"<arg_key>{k}</arg_key>{n}<arg_value>{v}</arg_value>{n}"
                                              for k, v in pairs) + "</tool_call>"


def minimax_block(*calls: tuple[str, tuple[tuple[str, str], ...]]) -> str:
    """One MiniMax-M2 block of calls, as its template writes it."""
    return "<minimax:tool_call>\n" + "".join(
        f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in pairs)
        + "</invoke>\n" for name, pairs in calls) + "</minimax:tool_call>"


CASES = [
    # a string parameter's value is its text, even when it reads as JSON; others are JSON
    ("Let me check.\n" + call("get_weather", ("city", "123"), ("days", "3"), ("units", "c"), ("tags", '["a", "b"]')),
     "Let me check.", [("get_weather", {"city": "123", "days": 3, "units": "c", "tags": ["a", "b"]})]),
    # two calls; a value with tags' look-alikes, quotes and newlines; GLM-4.7's tight form
    (call("note", ("text", 'a "quote" <b>\nline 2')) + "\n" + call("get_weather", ("city", "Oslo"), newlines=False),
     "", [("note", {"text": 'a "quote" <b>\nline 2'}), ("get_weather", {"city": "Oslo"})]),
    # an unknown function's values read as JSON where they are, else as text
    (call("other", ("n", "1.5"), ("s", "plain")), "", [("other", {"n": 1.5, "s": "plain"})]),
    ("No call: <tool is not a tag, 3 < 4.", "No call: <tool is not a tag, 3 < 4.", []),
]
QWEN3_CODER_CASES = [
    # values between newlines (not part of them), a value's own newlines kept; two calls
    ("I will check.\n" + call("get_weather", ("city", "123"), ("days", "3"), ("tags", '["a"]'), form=QWEN3_CODER)
     + "\n" + call("note", ("text", "line 1\n<b>line 2</b>\n"), form=QWEN3_CODER),
     "I will check.", [("get_weather", {"city": "123", "days": 3, "tags": ["a"]}),
                       ("note", {"text": "line 1\n<b>line 2</b>\n"})]),
    ("Plain <function=text> here.", "Plain <function=text> here.", []),
]
MINIMAX_CASES = [
    # two calls in one block (values as text or JSON by schema, tags' look-alikes in a value), then
    # a block of its own
    ("Let me check.\n" + minimax_block(("get_weather", (("city", "123"), ("days", "3"), ("tags", '["a"]'))),
                                       ("note", (("text", 'a "quote" <b>\nline 2'),)))
     + "\n" + minimax_block(("get_weather", (("city", "Oslo"),))),
     "Let me check.", [("get_weather", {"city": "123", "days": 3, "tags": ["a"]}),
                       ("note", {"text": 'a "quote" <b>\nline 2'}), ("get_weather", {"city": "Oslo"})]),
    (minimax_block(("note", ())), "", [("note", {})]),
    # a weak model's slips (found by review): stray words between calls are skipped; an empty
    # block is no call and no content; a call its block closes without </invoke> ends with it
    (minimax_block(("note", (("text", "a"),))).replace("</invoke>\n", "</invoke>\nsome words\n")
     .replace("</minimax:tool_call>", '<invoke name="note">\n<parameter name="text">b</parameter>\n</invoke>\n'
              "</minimax:tool_call>") + "\nDone.",
     "Done.", [("note", {"text": "a"}), ("note", {"text": "b"})]),
    ("Hi\n<minimax:tool_call>\n</minimax:tool_call>\nbye", "Hibye", []),  # as around any block
    (minimax_block(("get_weather", (("days", "1"),))).replace("</invoke>\n", "") + "\nafter",
     "after", [("get_weather", {"days": 1})]),
    ('No call: <minimax is <invoke name="x"> text.', 'No call: <minimax is <invoke name="x"> text.', []),
]


def _read(chunks: list[str], parallel: bool = True, form=GLM):
    reader = TagCallReader(form, lambda: f"call_{len(reader.calls)}", TOOLS, parallel)
    streamed, deltas = "", []
    for chunk in chunks:
        content, new = reader.feed(chunk)
        streamed += content
        deltas += new
    return reader, streamed + reader.finish(), deltas


@pytest.mark.parametrize("form, output, content, calls", [(GLM, *case) for case in CASES]
                         + [(QWEN3_CODER, *case) for case in QWEN3_CODER_CASES]
                         + [(MINIMAX, *case) for case in MINIMAX_CASES])
def test_calls_and_content_whatever_the_chunking(form, output, content, calls):
    for chunks in _chunkings(output, seed=len(output)):
        reader, streamed, deltas = _read(chunks, form=form)
        assert streamed == reader.text == content, chunks
        assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == calls, chunks
        assert all(c.complete for c in reader.calls)
        for index, made in enumerate(reader.calls):  # id and name first, then an argument at a time, then "}"
            mine = [d for d in deltas if d.index == index]
            assert (mine[0].id, mine[0].name, mine[0].arguments) == (made.id, made.name, "")
            assert all(d.id is None and d.name is None for d in mine[1:])
            assert "".join(d.arguments for d in mine) == made.arguments
            assert len(mine) == 2 + len(json.loads(made.arguments))  # an empty object: "{}" at once


@pytest.mark.parametrize("form, output", [(GLM, CASES[1][0]), (MINIMAX, MINIMAX_CASES[0][0])], ids=["glm", "minimax"])
def test_parallel_false_keeps_only_the_first_call(form, output):
    # MiniMax-M2's later calls share the first's block: read and dropped, their arguments too
    reader, _, deltas = _read([output], parallel=False, form=form)
    assert len(reader.calls) == 1 and {d.index for d in deltas} == {0}
    first = next(case for case in (CASES if form is GLM else MINIMAX_CASES) if case[0] == output)[2][0]
    assert (reader.calls[0].name, json.loads(reader.calls[0].arguments)) == first and reader.calls[0].complete


@pytest.mark.parametrize("form", [GLM, QWEN3_CODER, MINIMAX], ids=["glm", "qwen3_coder", "minimax"])
def test_a_reply_cut_inside_a_call_keeps_the_arguments_streamed_so_far(form):
    text = call("get_weather", ("city", "Paris"), ("days", "2"), form=form)
    value_end = "</arg_value>" if form is GLM else "</parameter>"
    name_end = text.index("\n") if form is GLM else text.index(">", len(form.open)) + 1
    for end in range(1, len(text)):
        reader = TagCallReader(form, lambda: "call_0", TOOLS)
        content, _ = reader.feed(text[:end])
        content += reader.finish(cut=True)
        named = end >= name_end + (form is GLM)
        if end < len(form.open):
            assert content == text[:end] and not reader.calls, end  # "<tool" may be text
            continue
        assert content == "", (end, content)
        assert [c.name for c in reader.calls] == (["get_weather"] if named else []), end
        if named:  # the arguments streamed: each once its value's closing tag came, the object unclosed
            # (MiniMax-M2's closed with its invoke, before the block closes)
            call_end = text.index("</invoke>") + len("</invoke>") if form is MINIMAX else len(text) + 1
            closed = [piece for piece, complete_at in (('{"city": "Paris"', text.index(value_end) + len(value_end)),
                                                       (', "days": 2', text.rindex(value_end) + len(value_end)),
                                                       ("}", call_end))
                      if complete_at <= end]
            assert reader.calls[0].arguments == "".join(closed), end


def test_a_dropped_call_the_reply_stops_inside_is_no_content():
    # parallel_tool_calls false: a second call is read and dropped, even unfinished (found by review)
    text = call("note", ("text", "a")) + "\n" + "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>B"
    reader, streamed, _ = _read([text], parallel=False)
    assert streamed == "" and [c.name for c in reader.calls] == ["note"]


def test_values_follow_the_schema_and_odd_schemas_do_not_break_the_reader():
    # a string enum stays text however it reads; an untyped value is JSON where it is; a boolean
    # schema (JSON Schema allows `true`) or no parameters at all is read as untyped
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "level": {"enum": ["1", "2"]}, "free": {}, "any": True}}}}, {"type": "function", "function": {"name": "g"}}]
    reader = TagCallReader(GLM, lambda: "c", tools)
    reader.feed(call("f", ("level", "1"), ("free", "[1]"), ("any", "x")) + call("g", ("n", "7")))
    assert [json.loads(c.arguments) for c in reader.calls] == [{"level": "1", "free": [1], "any": "x"}, {"n": 7}]


@pytest.mark.parametrize("family", ["glm", "qwen3_coder", "minimax"])
def test_a_forced_calls_grammar_takes_what_the_template_writes(tiny_model_dir, family):
    """The family is read off the template, and its grammar accepts the template's own rendering
    of a call (so constrained calls are written as the model was trained to write them)."""
    from meshllm.api.tool_formats import ToolFormat
    from meshllm.engine.grammar import GrammarCompiler
    from meshllm.model.tokenizer import Tokenizer
    from tests.api.tool_families import tiny_family_model

    tokenizer = Tokenizer.from_folder(tiny_family_model(tiny_model_dir, family, seed=31))
    fmt = ToolFormat.of(tokenizer)
    assert fmt.family == fmt.tag_form.family == family
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
        "required": ["city"]}}}]
    ask = {"role": "user", "content": "Weather?"}
    called = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]}
    messages, with_tools = fmt.template_inputs([ask, called], tools)
    after = tokenizer.apply_chat_template(messages, False, tools=with_tools)
    # the call's block (the last: MiniMax-M2's system prompt shows one), with the newline before it
    start = after.rindex(fmt.tag_form.open)
    start -= after[start - 1] == "\n"
    written = after[start:after.index(fmt.tag_form.close, start) + len(fmt.tag_form.close)]
    assert "Oslo" in written
    compiler = GrammarCompiler(tokenizer)
    matcher = compiler.matcher(compiler.lark(fmt.call_grammar(tools, parallel=False), "forced"))
    assert all(matcher.accept(t) for t in tokenizer.encode(written, add_special_tokens=False)), written
    assert matcher.is_accepting
    reader = fmt.call_reader(tools, parallel=False, forced=True)
    reader.feed(written)
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [("get_weather", {"city": "Oslo", "days": 2})]
