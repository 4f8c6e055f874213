"""Replies that think in a <think> block first (api/think.py): the block is reasoning_content,
the rest content (read for tool calls), whole or token by token, and where the prompt opened the
block the reply starts inside it. A tiny random model whose template ends the prompt inside a
block (as DeepSeek-R1's do) answers through real HTTP with its text as reasoning."""

from __future__ import annotations

import json
import random

import pytest

from meshllm.api.backend import build_local_backend
from meshllm.api.think import ThinkReader, prompt_opens_reasoning
from meshllm.api.tool_formats import ToolFormat
from meshllm.api.tool_parser import ToolCallParser
from meshllm.pipeline.cluster import ServingOptions
from tests.api.conftest import serve
from tests.api.tool_families import HERMES_TEMPLATE, tiny_family_model, with_template

HERMES = ToolFormat("hermes", True, "<tool_call>", None, "arguments", '"<tool_call>"', '"</tool_call>"')
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = [  # reply, starts inside the block, content, reasoning, calls
    ("<think>\nThe sky scatters blue.\n</think>\n\nYes, it is blue.", False, "Yes, it is blue.",
     "\nThe sky scatters blue.\n", []),
    ("  <think>a</think>b", False, "b", "a", []),
    ("The model skipped it. <think> later is text.", False, "The model skipped it. <think> later is text.", "", []),
    ("<thi", False, "<thi", "", []),  # a partial tag that never completes stays text
    ("Prefilled reasoning.</think>\n\nAnswer.", True, "Answer.", "Prefilled reasoning.", []),
    ("<think>Call it.</think>\n\n" + CALL, False, "", "Call it.", [("get_weather", {"city": "Paris"})]),
    ("<think>Still thinking when cut", False, "", "Still thinking when cut", []),
]


def _read(reply: str, in_reasoning: bool, chop: int | None, tools: bool):
    reader = ThinkReader(ToolCallParser(HERMES) if tools else None, in_reasoning)
    pieces = [reply] if chop is None else [reply[i:i + chop] for i in range(0, len(reply), chop)]
    content, reasoning = "", ""
    for piece in pieces:
        c, _ = reader.feed(piece)
        content, reasoning = content + c, reasoning + reader.reasoning_delta
    content += reader.finish()
    return reader, content, reasoning


@pytest.mark.parametrize("reply, in_reasoning, content, reasoning, calls", CASES)
@pytest.mark.parametrize("chop", [None, 1, 3])
def test_a_reply_splits_the_same_whole_and_streamed(reply, in_reasoning, content, reasoning, calls, chop):
    reader, streamed, streamed_reasoning = _read(reply, in_reasoning, chop, tools=bool(calls))
    assert (streamed, reader.text) == (content, content)
    assert (streamed_reasoning, "".join(reader.reasoning)) == (reasoning, reasoning)
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == calls


def test_random_chunkings_agree():
    reply = "<think>\nplan: a < b, and </thin is not the end\n</think>\n\n" + CALL + " done"
    want = _read(reply, False, None, tools=True)
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(reply)), 8))
        reader = ThinkReader(ToolCallParser(HERMES))
        for a, b in zip([0, *cuts], [*cuts, len(reply)]):
            reader.feed(reply[a:b])
        reader.finish()
        assert (reader.text, "".join(reader.reasoning), len(reader.calls)) == \
            (want[0].text, "".join(want[0].reasoning), 1)


def test_where_the_prompt_leaves_the_block():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


# DeepSeek-R1's generation prompt: the reply starts inside its reasoning
PREFILLED = HERMES_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
    "{#- a reasoning model's template: </think> #}")


def test_a_prompt_that_opens_the_block_makes_the_reply_reasoning(tiny_model_dir, tmp_path):
    assert PREFILLED != HERMES_TEMPLATE
    folder = with_template(tiny_family_model(tiny_model_dir, "hermes", seed=31), tmp_path, PREFILLED)
    backend = build_local_backend(folder, ServingOptions(context_length=512, max_batch=2))
    try:
        with serve(backend) as live:
            ask = dict(model=backend.model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                       temperature=0, logit_bias={str(backend.tokenizer.backend.token_to_id("<")): -100})
            message = live.client().chat.completions.create(**ask).choices[0].message
            # a random model never closes the block: all it wrote is reasoning
            assert message.content == "" and len(message.reasoning_content) > 0
            chunks = list(live.client().chat.completions.create(**ask, stream=True))
            streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
            assert streamed == message.reasoning_content
    finally:
        backend.close()


@pytest.mark.parametrize("family", ["hermes", "minimax"], ids=["tag-as-text", "tag-as-token"])
def test_a_grammar_holds_past_the_reasoning(tiny_model_dir, tmp_path, family):
    """A forced call or a JSON answer is constrained only past the reasoning: where the prompt
    opened the block, free reasoning, `</think>` (spelled out, or MiniMax-M2's token), then the
    answer; where it did not (Qwen3's), the reply may open a block first, or answer at once."""
    from meshllm.api.prompts import ModelText
    from meshllm.api.think import after_reasoning
    from meshllm.engine.grammar import GrammarCompiler, schema_text
    from meshllm.model.tokenizer import Tokenizer

    folder = tiny_family_model(tiny_model_dir, family, seed=31)
    if family == "hermes":  # DeepSeek-R1's way: the tags are text in its vocabulary
        folder = with_template(folder, tmp_path, PREFILLED)
    tokenizer = Tokenizer.from_folder(folder)
    model = ModelText.of(tokenizer, 2048)
    opening, close = model.reasoning_marks
    assert model.thinks and close.startswith("<[") == opening.startswith("<[") == (family == "minimax")
    compiler = GrammarCompiler(tokenizer)
    answer = "start: %json " + schema_text({"type": "object", "properties": {"a": {"type": "integer"}},
                                            "required": ["a"]})

    def accepts(text: str, may_open: bool) -> tuple[bool, bool]:  # (every token allowed, complete)
        grammar = compiler.lark(after_reasoning(answer, close, opening if may_open else None), "answer")
        matcher = compiler.matcher(grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept(t) for t in ids), matcher.is_accepting

    # the prompt opened the block
    assert accepts('Let me think: {"a": 2}?</think>\n\n{"a": 1}', False) == (True, True)
    assert accepts('</think>{"a": 1}', False) == (True, True)  # no reasoning at all
    assert accepts('{"a": 1}', False) == (True, False)  # inside the reasoning still: the answer is to come
    assert accepts('Thought.</think>\n\nplain words', False)[0] is False  # past the block the schema holds
    # the reply may open one
    assert accepts('<think>\nA thought.\n</think>\n\n{"a": 1}', True) == (True, True)
    assert accepts('\n<think>A thought.</think>\n{"a": 1}', True) == (True, True)  # GLM-4.5 writes "\n<think>"
    assert accepts('{"a": 1}', True) == (True, True)
    assert accepts('Thought.</think>{"a": 1}', True)[0] is False  # no block without its opening


def test_a_json_answer_after_the_reasoning_a_prompt_opened(tiny_model_dir):
    # MiniMax-M2's template opens <think> in the prompt: the JSON is the content, not reasoning
    folder = tiny_family_model(tiny_model_dir, "minimax", seed=31)
    backend = build_local_backend(folder, ServingOptions(context_length=2048, max_batch=2))
    close = backend.tokenizer.backend.token_to_id("</think>")
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}
    try:
        with serve(backend) as live:
            reply = live.client().chat.completions.create(
                model=backend.model_id, messages=[{"role": "user", "content": "A number?"}], max_tokens=60,
                temperature=0, logit_bias={str(close): 100},  # the random model closes its reasoning at once
                response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
            message = reply.choices[0].message
            assert reply.choices[0].finish_reason == "stop" and not getattr(message, "reasoning_content", None)
            assert json.loads(message.content)["n"] in (1, 2, 3)
    finally:
        backend.close()


def test_a_forced_call_may_come_after_reasoning_the_reply_opens(tiny_model_dir, tmp_path):
    # Qwen3's and GLM-4.5's way: the prompt does not open the block, the model does, then calls
    from tests.api.tool_families import MINIMAX_TEMPLATE

    opens_itself = MINIMAX_TEMPLATE.replace("{{- ']~b]ai' ~ '\\n' ~ '<think>' ~ '\\n' }}", "{{- ']~b]ai' ~ '\\n' }}")
    assert opens_itself != MINIMAX_TEMPLATE
    folder = with_template(tiny_family_model(tiny_model_dir, "minimax", seed=31), tmp_path, opens_itself)
    backend = build_local_backend(folder, ServingOptions(context_length=2048, max_batch=2))
    ids = {tag: backend.tokenizer.backend.token_to_id(tag) for tag in ("<think>", "</think>")}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}}}]
    try:
        with serve(backend) as live:
            # biased to open a block and close it: a random model would not
            reply = live.client().chat.completions.create(
                model=backend.model_id, messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                tool_choice="required", max_tokens=300, temperature=0, logprobs=True,
                logit_bias={str(ids["<think>"]): 50, str(ids["</think>"]): 100})
            choice = reply.choices[0]
            assert [t.token for t in choice.logprobs.content[:2]] == ["<think>", "</think>"]
            assert choice.finish_reason == "tool_calls" and not choice.message.content, [t.token for t in choice.logprobs.content]
            call = choice.message.tool_calls[0].function
            assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Oslo", "Rome")
    finally:
        backend.close()
