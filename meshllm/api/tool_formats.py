"""How a model's chat template speaks tool calls: one `ToolFormat` per template family.

The family is read from the template's own protocol markers, as llama.cpp does:

- mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects;
- mistral_args (Mistral Small 3.2, Devstral, Magistral, Ministral 3): `[TOOL_CALLS]NAME[ARGS]{...}`
  per call (api/mistral_calls.py);
- llama3: a bare JSON object {"name", "parameters"} (maybe after `<|python_tag|>`);
- harmony (GPT-OSS): a message to `functions.NAME` whose body is the arguments (api/harmony.py);
- glm (GLM-4.5, 4.6, 4.7): `<tool_call>NAME` then `<arg_key>`/`<arg_value>` tags per argument;
  qwen3_coder (Qwen3-Coder): `<tool_call>`, `<function=NAME>`, `<parameter=KEY>` per argument;
  minimax (MiniMax-M2): one `<minimax:tool_call>` block of `<invoke name="NAME">` calls, each
  with `<parameter name="KEY">` per argument (api/tag_calls.py);
- hermes: `<tool_call>\\n{"name", "arguments"}\\n</tool_call>` blocks (Qwen2.5, Qwen3, Hermes,
  SmolLM3 templates);
- a template that never mentions tools (SmolLM2's, the plain fallback) gets the Hermes
  protocol too, written by us: the tool list goes into the system message the way Qwen2.5's
  template writes it, earlier tool calls become `<tool_call>` blocks and tool results
  `<tool_response>` blocks in a user turn.

Templates that know tools get `tools` and the messages as transformers passes them
(arguments of earlier calls as objects, not JSON strings). A format also gives the
grammar that forces a call (tool_choice "required" or a named function): the call's
wrapper with the function's parameter schema embedded, so arguments always validate.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Literal

from meshllm.api import harmony, mistral_calls, tag_calls
from meshllm.api.harmony import HarmonyTokens
from meshllm.api.tag_calls import TagCallReader, TagForm
from meshllm.api.tool_parser import CallReader, ToolCallParser
from meshllm.engine.grammar import schema_text
from meshllm.model.tokenizer import Tokenizer

Family = Literal["hermes", "llama3", "mistral", "mistral_args", "harmony", "glm", "qwen3_coder", "minimax"]

HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class ToolFormat:
    family: Family
    template_renders_tools: bool  # False: we write tools and tool turns into the messages ourselves
    begin_text: str | None  # text that opens a call block (hermes "<tool_call>", mistral "[TOOL_CALLS]")
    begin_token: int | None  # special token that opens calls (skipped in the text, seen by its id)
    arguments_key: str  # "arguments", or "parameters" for llama3
    # Lark for the markers around a call: the token itself where the vocabulary has one (a model
    # writes `<tool_call>` as its one token, never spelled out), else the text.
    grammar_begin: str = '""'
    grammar_end: str = '""'
    harmony: HarmonyTokens | None = None  # GPT-OSS's markers (api/harmony.py reads and constrains its replies)
    tag_form: TagForm | None = None  # calls written with tags (api/tag_calls.py)
    tag_markers: dict[str, str] | None = None  # that form's tags (or mistral_args') -> their lark
    tag_ids: dict[str, int] | None = None  # mistral_args' tags that are special tokens -> their ids

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "ToolFormat":
        template = tokenizer.chat_template or ""
        markers = HarmonyTokens.of({t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items()})
        if "<|channel|>" in template and markers is not None:
            return cls("harmony", True, None, None, "arguments", harmony=markers)
        for form in tag_calls.FORMS:
            if form.detect in template:
                markers = {tag: lark_marker(tokenizer, tag) for tag in form.markers}
                return cls(form.family, True, form.open, None, "arguments", markers[form.open],
                           tag_form=form, tag_markers=markers)
        if "[ARGS]" in template and "[TOOL_CALLS]" in template:
            tags = mistral_calls.TOOL_CALLS, mistral_calls.ARGS, mistral_calls.CALL_ID
            ids = {tag: i for tag in tags if (i := _special_id(tokenizer, tag)) is not None}
            markers = {tag: lark_marker(tokenizer, tag) for tag in tags if tag in template}
            return cls("mistral_args", True, mistral_calls.TOOL_CALLS, ids.get(mistral_calls.TOOL_CALLS), "arguments",
                       markers[mistral_calls.TOOL_CALLS], tag_markers=markers, tag_ids=ids)
        if "[TOOL_CALLS]" in template:
            return cls("mistral", True, "[TOOL_CALLS]", _special_id(tokenizer, "[TOOL_CALLS]"), "arguments",
                       lark_marker(tokenizer, "[TOOL_CALLS]"))
        if "<|python_tag|>" in template or "ipython" in template:
            return cls("llama3", True, None, _special_id(tokenizer, "<|python_tag|>"), "parameters")
        return cls("hermes", "<tool_call>" in template and "tools" in template, "<tool_call>", None, "arguments",
                   lark_marker(tokenizer, "<tool_call>"), lark_marker(tokenizer, "</tool_call>"))

    def call_reader(self, tools: list[dict], parallel: bool, forced: bool) -> CallReader:
        """What reads a reply's tool calls as it streams (`forced`: a grammar makes it calls only)."""
        if self.tag_form is not None:
            return TagCallReader(self.tag_form, self.new_call_id, tools, parallel, forced)
        if self.family == "mistral_args":
            return mistral_calls.ArgsCallReader(self.tag_ids, self.new_call_id, parallel, forced)
        return ToolCallParser(self, parallel, forced)

    def new_call_id(self) -> str:
        if self.family in ("mistral", "mistral_args"):  # Mistral's templates refuse ids not 9 letters or digits
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"

    # --- prompt ----------------------------------------------------------------------------------
    def template_inputs(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) to render with the chat template. `messages` are OpenAI-shaped dicts
        whose tool calls carry `arguments` as JSON text."""
        if self.template_renders_tools:
            return [_with_argument_objects(m) for m in messages], tools or None
        return _hermes_messages(messages, tools), None

    # --- grammar ---------------------------------------------------------------------------------
    def answer_grammar(self, answer: dict) -> str | None:
        """Lark for a reply that is a JSON document matching `answer`, where the format wraps the
        reply (harmony); None: the document is the whole reply (a JSON-schema grammar)."""
        return None if self.harmony is None else harmony.answer_grammar(self.harmony, answer)

    def call_grammar(self, tools: list[dict], parallel: bool, answer: dict | None = None) -> str:
        """Lark grammar (llguidance) for one call (or several when `parallel`) to any of `tools`,
        or, when `answer` (a JSON schema) is given, either that or a plain answer matching it."""
        if self.harmony is not None:
            return harmony.call_grammar(self.harmony, tools, answer)
        calls = self._calls_grammar(tools, parallel)
        if answer is None:
            return f"start: calls\n{calls}"
        return f"start: calls | answer\nanswer: %json {schema_text(answer)}\n{calls}"

    def text_or_call_grammar(self, tools: list[dict], parallel: bool) -> str:
        """Lark for a reply that is free text or calls to `tools` whose arguments match their schemas
        (tool_choice auto with strict tools). Text may come before a call block (hermes, mistral),
        never inside one; a llama3 call is the whole reply, so text there is anything that does not
        open a JSON object (llguidance's own example for Llama 3.1)."""
        if self.harmony is not None:
            return harmony.text_or_call_grammar(self.harmony, tools)
        calls = self._calls_grammar(tools, parallel)
        begin = self.grammar_begin
        if begin == '""':
            return f"start: TEXT | calls\nTEXT: /[^{{](?s:.*)/\n{calls}"
        # Text never holds the opening spelled out either (the parser would read it as one).
        text = f"/(?s:.+)/ & ~(/(?s:.*)/ {json.dumps(self.begin_text)} /(?s:.*)/)"
        if begin.startswith("<["):  # the opening is a token of its own: text ends where it comes
            return f"start: TEXT | TEXT? calls\nTEXT: {text}\n{calls}"
        # The text before a call ends at the call's opening, which it consumes (a lazy lexeme with
        # llguidance's `suffix`: a greedy one would have eaten "<tool_call" before seeing the ">").
        return f"start: TEXT | pre first\nTEXT: {text}\npre[suffix={begin}]: /(?s:.*)/\n{calls}"

    def _calls_grammar(self, tools: list[dict], parallel: bool) -> str:
        """`calls` (a call block, opening included) and `first` (the first call after its opening)."""
        if self.tag_form is not None:
            return tag_calls.calls_grammar(self.tag_form, self.tag_markers, tools, parallel)
        if self.family == "mistral_args":
            return mistral_calls.calls_grammar(self.tag_markers, tools, parallel, schema_text)
        options = [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            self.arguments_key: t["function"].get("parameters") or {"type": "object"}},
            "required": ["name", self.arguments_key], "additionalProperties": False} for t in tools]
        call = options[0] if len(options) == 1 else {"anyOf": options}
        if self.family == "mistral":
            array = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
            return f"calls: {self.grammar_begin} first\nfirst: body\nbody: %json {schema_text(array)}\n"
        if self.family == "llama3":  # one call per turn: Llama 3.x's JSON tool calling has no parallel form
            return f"calls: body\nbody: %json {schema_text(call)}\n"
        block = f'"\\n" body "\\n" {self.grammar_end}'
        more = f' ("\\n" call)*\ncall: {self.grammar_begin} {block}' if parallel else ""
        return f"calls: {self.grammar_begin} first\nfirst: {block}{more}\nbody: %json {schema_text(call)}\n"


def lark_marker(tokenizer: Tokenizer, text: str) -> str:
    """`text` in lark: its token where the vocabulary has it as one (a model writes it so), else quoted."""
    for token_id, added in tokenizer.backend.get_added_tokens_decoder().items():
        if added.content == text:
            return f"<[{token_id}]>"
    return json.dumps(text)


def _special_id(tokenizer: Tokenizer, text: str) -> int | None:
    """Id of `text` when it is a special token (decoding skips it), else None (plain text)."""
    for token_id, added in tokenizer.backend.get_added_tokens_decoder().items():
        if added.content == text and added.special:
            return token_id
    return None


def _arguments_object(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # not JSON: the template shows it as the client sent it


def _with_argument_objects(message: dict) -> dict:
    # transformers' templates expect arguments as objects (they apply `tojson` themselves)
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _arguments_object(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    out: list[dict] = []
    if tools:
        listing = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":  # a developer message arrives as one too
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{listing}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": listing})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"],
                                  "arguments": _arguments_object(c["function"]["arguments"])}, ensure_ascii=False)
                      for c in m["tool_calls"]]
            text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
            out.append({"role": "assistant", "content": f"{m['content']}\n{text}" if m.get("content") else text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{block}"}  # one turn per batch
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    return out
