"""Tool calls of Mistral's newer templates (api/mistral_calls.py): `[TOOL_CALLS]NAME[ARGS]{...}` per
call, the tags as special tokens (seen by id, no text) or as text, read whole and in every
chunking, cut anywhere."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from meshllm.api.mistral_calls import ArgsCallReader
from tests.api.test_tool_parser import _chunkings

IDS = {"[TOOL_CALLS]": 9, "[ARGS]": 10, "[CALL_ID]": 11}
ARGS = {"city": "Paris", "note": "a \"quoted\" {brace} [ARGS] and \\ back"}
CASES = [
    # content before a call; arguments with braces, quotes, escapes and a tag's text inside a string
    ("Let me check.[TOOL_CALLS]get_weather[ARGS]" + json.dumps(ARGS), "Let me check.", [("get_weather", ARGS)]),
    # two calls; Mistral Small 3.2's id between the name and its arguments, dropped; no arguments
    ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("No call: [ARGS] alone and [TOOL is text.", "No call: [ARGS] alone and [TOOL is text.", []),
]


def pieces(output: str, as_tokens: bool, seed: int) -> list[list[tuple[str, int | None]]]:
    """Chunkings of `output` as (text, token id) pieces: each tag a token of its own (no text),
    or text cut anywhere."""
    if not as_tokens:
        return [[(c, None) for c in chunks] for chunks in _chunkings(output, seed)]
    parts, start, i, in_string = [], 0, 0, False
    while i < len(output):  # a tag is a token where the model writes one: not in a JSON string, not in prose
        if output[i] == '"' and output[i - 1] != "\\":
            in_string = not in_string
        tag = next((t for t in IDS if output.startswith(t, i)), None)
        if tag is not None and not in_string and "[TOOL_CALLS]" in output[:i + len(tag)]:
            parts += [output[start:i], tag]
            start = i = i + len(tag)
            continue
        i += 1
    parts.append(output[start:])
    rng, out = random.Random(seed), []
    for _ in range(4):
        chunked = []
        for part in parts:
            if part in IDS:
                chunked.append(("", IDS[part]))
            elif part:
                cuts = sorted(rng.sample(range(1, len(part)), min(len(part) - 1, rng.randint(0, 5)))) if len(part) > 1 \
                    else []
                chunked += [(part[a:b], None) for a, b in zip([0, *cuts], [*cuts, len(part)])]
        out.append(chunked)
    return out


def _read(feed: list[tuple[str, int | None]], ids: dict, parallel: bool = True, cut: bool = False):
    reader = ArgsCallReader(ids, lambda: f"call_{len(reader.calls)}", parallel)
    streamed, deltas = "", []
    for text, token in feed:
        content, new = reader.feed(text, token)
        streamed += content
        deltas += new
    return reader, streamed + reader.finish(cut), deltas


@pytest.mark.parametrize("as_tokens", [True, False], ids=["tags-as-tokens", "tags-as-text"])
@pytest.mark.parametrize("output, content, calls", CASES)
def test_calls_and_content_whatever_the_chunking(output, content, calls, as_tokens):
    for feed in pieces(output, as_tokens, seed=len(output)):
        reader, streamed, deltas = _read(feed, IDS if as_tokens else {})
        assert streamed == reader.text == content, feed
        assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == calls, feed
        assert all(c.complete for c in reader.calls)
        for index, made in enumerate(reader.calls):  # id and name first, then the arguments' text as it grows
            mine = [d for d in deltas if d.index == index]
            assert (mine[0].id, mine[0].name, mine[0].arguments) == (made.id, made.name, "")
            assert all(d.id is None and d.name is None for d in mine[1:])
            assert "".join(d.arguments for d in mine) == made.arguments


def test_parallel_false_keeps_only_the_first_call():
    reader, content, deltas = _read(pieces(CASES[1][0], True, 0)[0], IDS, parallel=False)
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [("get_weather", {"city": "Oslo"})]
    assert content == "" and {d.index for d in deltas} == {0}


def test_a_reply_cut_inside_a_call_keeps_the_arguments_streamed_so_far():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
    args_at = text.index("{")
    for end in range(1, len(text)):
        reader, content, _ = _read([(text[:end], None)], {}, cut=True)
        assert content == ("" if end >= len("[TOOL_CALLS]") else text[:end]), end  # "[TOOL" may be text
        named = end >= args_at
        assert [c.name for c in reader.calls] == (["get_weather"] if named else []), end
        if named:
            assert reader.calls[0].arguments == text[args_at:end] and not reader.calls[0].complete, end


# Mistral Small 3.2's published template (as llama.cpp's models/templates ships it), which writes
# each call's id between its name and its arguments
MISTRAL_SMALL_3_2 = (Path(__file__).parent / "templates" / "mistral_small_3_2.jinja").read_text()


@pytest.mark.parametrize("template", ["devstral-style", "mistral-small-3.2"])
def test_a_forced_calls_grammar_takes_what_the_template_writes(tiny_model_dir, tmp_path, template):
    """The family is read off the template, and its grammar accepts the template's own rendering
    of two calls (ids and all), which the reader reads back."""
    from meshllm.api.tool_formats import ToolFormat
    from meshllm.engine.grammar import GrammarCompiler
    from meshllm.model.tokenizer import Tokenizer
    from tests.api.tool_families import tiny_family_model, with_template

    folder = tiny_family_model(tiny_model_dir, "mistral_args", seed=31)
    if template == "mistral-small-3.2":
        folder = with_template(folder, tmp_path, MISTRAL_SMALL_3_2)
    tokenizer = Tokenizer.from_folder(folder)
    fmt = ToolFormat.of(tokenizer)
    assert fmt.family == "mistral_args" and set(fmt.tag_ids) == {"[TOOL_CALLS]", "[ARGS]"}  # the family's specials
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}]
    ask = {"role": "user", "content": "Weather?"}
    called = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a1b2c3d4e", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "f5g6h7i8j", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Rome", "days": 2}'}}]}
    messages, with_tools = fmt.template_inputs([ask, called], tools)
    after = tokenizer.apply_chat_template(messages, False, tools=with_tools)
    written = after[after.rindex("[/INST]") + len("[/INST]"):after.rindex("</s>")]
    assert written.count("[TOOL_CALLS]") == 2 and ("[CALL_ID]" in written) == (template == "mistral-small-3.2")
    compiler = GrammarCompiler(tokenizer)
    matcher = compiler.matcher(compiler.lark(fmt.call_grammar(tools, parallel=True), "forced"))
    ids = tokenizer.encode(written, add_special_tokens=False)
    assert all(matcher.accept(t) for t in ids), written
    assert matcher.is_accepting
    reader = fmt.call_reader(tools, parallel=True, forced=True)
    for i in ids:
        reader.feed(tokenizer.decode([i], skip_special_tokens=True), i)
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [("get_weather", {"city": "Oslo"}),
                                                                         ("get_weather", {"city": "Rome", "days": 2})]


def test_a_tag_the_vocabulary_holds_as_a_token_is_text_when_written_as_text():
    # Devstral writing code that splits on the tags (found by review): no call, all content
    code = 'Split it: `name, args = s.split("[TOOL_CALLS]")[1].split("[ARGS]")` then json.loads(args).'
    for feed in pieces(code, False, seed=3):
        reader, content, _ = _read(feed, IDS)
        assert content == code and not reader.calls, feed


@pytest.mark.parametrize("as_tokens", [True, False], ids=["tags-as-tokens", "tags-as-text"])
def test_a_tag_no_function_name_follows_is_text(as_tokens):
    # the tag then prose, not a name: content as written, streamed as it comes (found by review)
    text = "Use the [TOOL_CALLS] token to call, then answer. [TOOL_CALLS]get_time[ARGS]{}"
    for feed in pieces(text, as_tokens, seed=5):
        reader, content, _ = _read(feed, IDS if as_tokens else {})
        assert content == "Use the [TOOL_CALLS] token to call, then answer. ", feed
        assert [(c.name, c.arguments) for c in reader.calls] == [("get_time", "{}")]


def test_a_tag_token_inside_an_arguments_string_ends_them():
    # a special token is never part of a string's text: the arguments end there, unclosed, and no
    # internal mark reaches the client (found by review)
    feed = [("", IDS["[TOOL_CALLS]"]), ("f", None), ("", IDS["[ARGS]"]), ('{"a": "x ', None), ("", IDS["[TOOL_CALLS]"]),
            ("g", None), ("", IDS["[ARGS]"]), ("{}", None)]
    reader, content, _ = _read(feed, IDS)
    assert [(c.name, c.arguments, c.complete) for c in reader.calls] == [("f", '{"a": "x ', False), ("g", "{}", True)]
    assert content == ""
