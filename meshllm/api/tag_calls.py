"""Tool calls written with tags, not JSON: GLM-4.5 / 4.6 / 4.7's, Qwen3-Coder's and MiniMax-M2's
templates.

    GLM:                           Qwen3-Coder:      MiniMax-M2:
    <tool_call>get_weather         <tool_call>       <minimax:tool_call>
    <arg_key>city</arg_key>        <function=get_weather>             <invoke name="get_weather">
    <arg_value>Paris</arg_value>   <parameter=city>  <parameter name="city">Paris</parameter>
    </tool_call>                   Paris             </invoke>
                                   </parameter>      <invoke name="...">...</invoke>
                                   </function>       </minimax:tool_call>
                                   </tool_call>

A `TagForm` says where a block of calls opens and closes, where a call's name and each argument's
key and value lie, and where a call ends (the block's end, but for MiniMax-M2's, whose one block
holds every call of a turn, each its own invoke). A value is its text
for a string parameter (and for one whose schema names no type), else JSON (the templates write
other values with `tojson`); text that is no JSON stays text, as vLLM's parsers read them. GLM's
name ends at the first newline or tag (GLM-4.7 writes no newlines between tags); Qwen3-Coder's
values sit between newlines, which are not part of them. A call's id and name stream once the
name is complete; its arguments as a JSON object growing one argument at a time, each when its
value closes, and closed with the block. A call cut at the token limit keeps the arguments
streamed so far, as OpenAI reports a cut call.

`TagCallReader` has ToolCallParser's interface; `calls_grammar` gives the lark a forced or strict
call must match: each parameter's value typed by its schema (text for strings, with their enum or
maxLength; JSON by llguidance's %json for the rest), required ones in order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from meshllm.api.tool_parser import CallDelta, CallReader, ParsedCall
from meshllm.engine.grammar import schema_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class TagForm:
    family: str
    detect: str  # text only this family's templates hold
    name: re.Pattern  # at a call's start, once its name is complete: group 1 the name
    argument: re.Pattern  # one whole argument at the start of the text: groups 1 and 2 key and value
    opens: str  # the text an argument starts with
    value_opens: str  # after it, a value is open until the argument closes
    strip_value_newlines: bool  # the value's one leading and one trailing newline are layout
    markers: tuple[str, ...]  # the tags a vocabulary may hold as tokens of their own
    open: str = OPEN  # a block of calls
    close: str = CLOSE
    call_close: str = CLOSE  # a call's end: the block's, where a block holds one call
    call_open: str = OPEN  # a call's start, where a block holds several (the text its name pattern opens with)


GLM = TagForm("glm", "<arg_key>", re.compile(r"(.*?)(?=\n|<arg_key>|</tool_call>)", re.DOTALL),
              re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL),
              "<arg_key>", "<arg_value>", False,
              (OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))
QWEN3_CODER = TagForm("qwen3_coder", "<parameter=", re.compile(r"\s*<function=([^>\n]*)>"),
                      re.compile(r"\s*<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL),
                      "<parameter=", "<parameter=", True, (OPEN, CLOSE))
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX = TagForm("minimax", MINIMAX_OPEN, re.compile(r'\s*<invoke name="([^"\n]*)">'),
                  re.compile(r'\s*<parameter name="([^"\n]*)">(.*?)</parameter>', re.DOTALL),
                  "<parameter name=", "<parameter name=", False, (MINIMAX_OPEN, MINIMAX_CLOSE),
                  MINIMAX_OPEN, MINIMAX_CLOSE, "</invoke>", "<invoke name=")
FORMS = (GLM, QWEN3_CODER, MINIMAX)


def is_text(spec: dict) -> bool:
    """Whether a parameter's value is written as its text (not JSON): a string, a string enum, or
    a parameter whose schema says neither type nor enum."""
    if "enum" in spec:
        return all(isinstance(v, str) for v in spec["enum"])
    return spec.get("type", "string") == "string"


class TagCallReader(CallReader):
    """One choice's reply. States: content (looking for the block's opening), call (inside a
    block), between (whitespace after a block)."""

    def __init__(self, form: TagForm, new_call_id, tools: list[dict], parallel: bool = True, forced: bool = False):
        super().__init__(parallel, forced)
        self.form, self.new_call_id = form, new_call_id
        self.specs = {t["function"]["name"]: _properties(t["function"].get("parameters")) for t in tools}
        self._call: ParsedCall | None = None  # the open block's (latest) call, once its name is complete
        self._named = False  # a call of the open block is open (its name read): arguments follow
        self._dropped = False  # the open call is a later one where only one may be made

    def finish(self, cut: bool = False) -> str:
        """Content still held at the end. Inside a block nothing is content: its call keeps the
        arguments streamed so far (a dropped call is gone), and a block cut before its name was
        complete is gone too, unless the reply stopped there by itself (its text then stays, as
        ToolCallParser keeps it)."""
        held, self._held = self._held, ""
        if self._state == "call":
            if self._call is not None or self._dropped or cut or self.forced:
                return ""
            return self._emit(held)
        if cut and self.forced:
            return ""
        return self._emit(held) if self._state == "content" else ""

    def _step(self, deltas: list[CallDelta]) -> bool:
        opening = self.form.open
        if self._state == "content":
            at = self._held.find(opening)
            if at < 0:  # keep what may be the start of the tag, and the whitespace before it
                keep = next((n for n in range(min(len(opening) - 1, len(self._held)), 0, -1)
                             if self._held.endswith(opening[:n])), 0)
                decided = self._held[:len(self._held) - keep].rstrip()
                self._emit(decided)
                self._held = self._held[len(decided):]
                return False
            self._emit(self._held[:at].rstrip())  # the templates' newline before a call is no content
            self._held, self._state = self._held[at + len(opening):], "call"
            self._call, self._named, self._dropped = None, False, False
            return True
        if self._state == "between":
            self._held = self._held.lstrip()
            self._state = "content" if self._held else "between"
            return bool(self._held)
        return self._read_block(deltas)

    def _read_block(self, deltas: list[CallDelta]) -> bool:
        form = self.form
        many = form.call_close != form.close  # MiniMax's: a block of calls, each closed on its own
        if not self._named:
            rest = self._held.lstrip()
            if many and rest.startswith(form.close):  # the block ends (after its calls, or none)
                self._held, self._state = rest[len(form.close):], "between"
                return True
            name = form.name.match(self._held)
            if name is None:
                # between MiniMax's calls, stray words are skipped up to the next call or the block's end
                tag = min((at for at in (rest.find(form.call_open), rest.find(form.close)) if at > 0), default=None)
                if many and tag is not None:
                    self._held = rest[tag:]
                    return True
                return False
            self._start(name.group(1).strip(), deltas)
            self._held = self._held[name.end():]
        while (argument := form.argument.match(self._held)) is not None:
            self._held = self._held[argument.end():]
            key, text = argument.group(1).strip(), argument.group(2)
            if form.strip_value_newlines:
                text = text.removeprefix("\n").removesuffix("\n")
            value = _value(text, self.specs.get(self._call.name if self._call else "", {}).get(key, {}))
            self._stream(("{" if self._call is not None and not self._call.arguments else ", ")
                         + json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False), deltas)
        rest = self._held.lstrip()
        ends_block = many and rest.startswith(form.close)  # a call left open when its block closes ends with it
        if rest.startswith(form.call_close) or ends_block:
            self._stream("}" if self._call is not None and self._call.arguments else "{}", deltas)
            if self._call is not None and not self._dropped:
                self._call.complete = True
            self._named = False
            if ends_block or not many:
                self._held, self._state = rest[len(form.close):], "between"
            else:
                self._held = rest[len(form.call_close):]
            return True
        # Text that is no argument (Qwen3-Coder's </function>, a weak model's stray words) is
        # skipped up to the next tag that is, unless a value is open in it
        tags = (form.opens, form.call_close, *((form.close,) if many else ()))
        tag = min((at for at in (rest.find(t) for t in tags) if at > 0), default=None)
        if tag is not None and form.value_opens not in rest[:tag]:
            self._held = rest[tag:]
            return True
        return False

    def _start(self, name: str, deltas: list[CallDelta]) -> None:
        self._named = True
        if not self.parallel and self.calls:
            self._call, self._dropped = None, True  # only one call may be made: later ones are read, dropped
            return
        self._call, self._dropped = ParsedCall(self.new_call_id(), name), False
        self.calls.append(self._call)
        deltas.append(CallDelta(len(self.calls) - 1, self._call.id, name))

    def _stream(self, piece: str, deltas: list[CallDelta]) -> None:
        if self._call is not None:
            self._call.arguments += piece
            deltas.append(CallDelta(self.calls.index(self._call), arguments=piece))


def _properties(schema) -> dict[str, dict]:
    """A function's parameters' schemas by name ({} for a boolean or missing one)."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return {}
    return {k: v if isinstance(v, dict) else {} for k, v in properties.items()}


def _value(text: str, spec: dict) -> object:
    """A string parameter's value as its text; any other (an untyped one too) as JSON where the
    text is JSON, else as the text."""
    if ("type" in spec or "enum" in spec) and is_text(spec):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def calls_grammar(form: TagForm, markers: dict[str, str], tools: list[dict], parallel: bool) -> str:
    """Lark rules `calls` (the opening and every call) and `first` (what follows the opening) for
    calls to `tools` in `form`. `markers`: each tag's lark (its token, or its text quoted).
    Newlines as the templates write them (GLM-4.5's optional: GLM-4.7's write none)."""
    glm, minimax = form is GLM, form is MINIMAX
    m, nl = markers, '"\\n"?' if glm else '"\\n"'
    rules, bodies = [], []
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
        properties = _properties(schema)
        required = set(schema.get("required") or ())

        def argument(key: str, value: str) -> str:  # `key` lark, `value` the rule of the value and its end
            if glm:
                return f'{m["<arg_key>"]} {key} {m["</arg_key>"]} {nl} {m["<arg_value>"]} {value} {nl}'
            if minimax:
                return f'"<parameter name=\\"" {key} "\\">" {value} "\\n"'
            return f'"<parameter=" {key} ">\\n" {value} "\\n"'

        end = m["</arg_value>"] if glm else json.dumps("</parameter>" if minimax else "\n</parameter>")
        arguments = []
        for j, (key, spec) in enumerate(properties.items()):
            rules.append(_value_rule(f"v{i}_{j}", spec, end))
            arguments.append(f"({argument(json.dumps(key), f'v{i}_{j}')})" + ("" if key in required else "?"))
        if not properties and schema.get("additionalProperties", True) is not False:  # any keys
            rules.append(_value_rule(f"any{i}", {}, end))
            arguments.append(f"({argument(MINIMAX_ANY_KEY if minimax else ANY_KEY, f'any{i}')})*")
        if minimax:
            name, closing = json.dumps(f'<invoke name="{function["name"]}">'), '"</invoke>\\n"'
        elif glm:
            name, closing = json.dumps(function["name"]), m[CLOSE]
        else:
            name, closing = json.dumps(f"<function={function['name']}>"), f'"</function>\\n" {m[CLOSE]}'
        rules.append(f"tool{i}: {name} {nl} {' '.join(arguments)} {closing}")
        bodies.append(f"tool{i}")
    opening = m[form.open]
    if minimax:  # one block holds every call, each an invoke on lines of its own
        first = f'"\\n" body{" body*" if parallel else ""} {m[form.close]}'
    else:
        lead = "" if glm else '"\\n" '  # Qwen3-Coder's templates start each call on a line of its own
        first = f"{lead}body" + (f' ("\\n" {opening} {lead}body)*' if parallel else "")
    # the templates write a newline before each block
    return "\n".join([f'calls: "\\n"? {opening} first', f"first: {first}",
                      f"body: {' | '.join(bodies)}", *rules]) + "\n"


ANY_KEY = "/[^<>\\n]+/"  # a key of a function whose parameters are any
MINIMAX_ANY_KEY = '/[^<>"\\n]+/'  # the same, between MiniMax's quotes


def _value_rule(name: str, spec: dict, end: str) -> str:
    """Rule `name`: a value and its closing tag. Text for a string parameter (its enum's literals,
    or text up to maxLength that does not close the value) and for an untyped one (the reader
    takes it as JSON where it is); JSON of its schema for the rest."""
    if not is_text(spec):
        return f"{name}: %json {schema_text(spec)} {end}"
    if "enum" in spec:
        return f"{name}: (" + " | ".join(json.dumps(v) for v in spec["enum"]) + f") {end}"
    most = spec.get("maxLength")
    text = f"/(?s:.{{0,{int(most)}}})/" if most is not None else "/(?s:.*)/"
    if end.startswith("<["):  # the closing tag is a token of its own: the text ends where it comes
        return f"{name}: {text} {end}"
    # a lazy lexeme ending at the tag, which it consumes (a greedy one would take "</arg_value"
    # into the text before seeing the ">": as tool_formats' text before a call)
    return f"{name}[suffix={end}]: {text}"
