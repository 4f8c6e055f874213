"""Tool calls of Mistral's newer templates (Mistral Small 3.2, Devstral, Magistral, Ministral 3):

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

each call its own `[TOOL_CALLS]`, the name as text, the arguments a JSON object after `[ARGS]`
(Mistral Small 3.2 shows an id between them in its history, `[CALL_ID]abcdefghi`, which a reply
may write too: it is read and dropped, as vLLM does; the server names its calls). The tags are
special tokens in Mistral's tokenizers, so a reply's text skips them: they are seen by id (or as
text, where a vocabulary lacks them). The earlier form, `[TOOL_CALLS] [{"name": ..., "arguments":
...}]`, stays the "mistral" family (api/tool_parser.py).

A call's id and name stream once `[ARGS]` ends the name; its arguments as their JSON text grows
(a scanner finds where the object ends: strings, escapes, nesting). A call cut at the token limit
keeps the arguments streamed so far.
"""

from __future__ import annotations

import json
import re

from meshllm.api.tool_parser import CallDelta, CallReader, JsonNesting, ParsedCall

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# What a call's name may be (OpenAI's function names, and dots and colons): held text that cannot
# become one shows the tag was no call
_NAME_MAX = 64
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,%d}" % _NAME_MAX)
_NAME_START = re.compile(r"[A-Za-z0-9_.:-]*")
_TAGS = (TOOL_CALLS, ARGS, CALL_ID)
# A tag stands in the held text as one of these (a special token has no text of its own)
_MARK = {tag: f"\x00{i}\x00" for i, tag in enumerate(_TAGS)}


class ArgsCallReader(CallReader):
    """One choice's reply. States: content, name (after [TOOL_CALLS]), call_id (after [CALL_ID]),
    args (after [ARGS]), between (after a call's object)."""

    def __init__(self, tag_ids: dict[str, int], new_call_id, parallel: bool = True, forced: bool = False):
        """`tag_ids`: the vocabulary's token id of each tag that is a token of its own."""
        super().__init__(parallel, forced)
        self.new_call_id = new_call_id
        self._tag_of = {i: tag for tag, i in tag_ids.items()}
        # a tag the vocabulary has as a token counts only as that token: its text in a reply (code
        # that splits on "[TOOL_CALLS]") is text, as vLLM reads it
        self._as_text = tuple(tag for tag in _TAGS if tag not in tag_ids)
        self._call: ParsedCall | None = None  # the call whose arguments are being read (None: dropped)
        self._name: str | None = None  # the open call's name, once [ARGS] or [CALL_ID] ended it
        self._json = JsonNesting()  # where the open call's arguments text stands

    def feed(self, text: str, token_id: int | None = None) -> tuple[str, list[CallDelta]]:
        tag = self._tag_of.get(token_id) if token_id is not None else None
        return super().feed(_MARK[tag] if tag is not None else text, token_id)

    def finish(self, cut: bool = False) -> str:
        """Content still held at the end. After [TOOL_CALLS] nothing is content: a call with a name
        keeps the arguments it got (incomplete), one cut before [ARGS] is gone; a reply that
        stopped by itself in a name keeps that text (it shows what the model wrote)."""
        held, self._held = self._held, ""
        if self._state == "content":
            return "" if cut and self.forced else self._emit(_unmarked(held))
        if self._state == "name" and not cut and not self.forced:
            return self._emit(_unmarked(TOOL_CALLS + held))
        return ""

    def _step(self, deltas: list[CallDelta]) -> bool:
        if self._state in ("content", "between"):
            return self._find_call()
        if self._state in ("name", "call_id"):
            return self._read_name(deltas)
        return self._read_args(deltas)

    def _find(self, tag: str) -> tuple[int, int]:
        """(where, length) of the first `tag` in the held text, as a token's mark or as its text
        (a vocabulary without it as a token); (-1, 0) for none."""
        forms = (_MARK[tag], tag) if tag in self._as_text else (_MARK[tag],)
        found = [(at, len(t)) for t in forms if (at := self._held.find(t)) >= 0]
        return min(found) if found else (-1, 0)

    def _find_call(self) -> bool:
        at, length = self._find(TOOL_CALLS)
        if at < 0:
            # keep what may be the start of a tag written as text
            keep = self._partial(self._held, TOOL_CALLS)
            decided = self._held[:len(self._held) - keep]
            if self._state == "between":  # after a call: whitespace is layout, words are content
                decided = decided.lstrip()
            self._emit(_unmarked(decided))
            if decided:
                self._state = "content"
            self._held = self._held[len(self._held) - keep:]
            return False
        before = self._held[:at]
        self._emit(_unmarked(before if self._state == "content" else before.lstrip()))
        self._held, self._state = self._held[at + length:], "name"
        return True

    def _read_name(self, deltas: list[CallDelta]) -> bool:
        at, length = self._find(ARGS)
        id_at, id_length = self._find(CALL_ID) if self._state == "name" else (-1, 0)
        if self._state == "name" and not self._may_be_name(at, id_at):
            # no function name follows: the tag was text the model wrote, and so is what follows
            # it, up to a next call's tag
            rest = self._find(TOOL_CALLS)[0]
            if rest < 0:  # keep what may be the start of the next tag written as text
                rest = len(self._held) - self._partial(self._held, TOOL_CALLS)
            self._emit(_unmarked(TOOL_CALLS + self._held[:rest]))
            self._held, self._state = self._held[rest:], "content"
            return True
        if self._state == "name":
            if 0 <= id_at and (at < 0 or id_at < at):  # the name ends at [CALL_ID]; the id is dropped
                self._name = self._held[:id_at].strip()
                self._held, self._state = self._held[id_at + id_length:], "call_id"
                return True
            self._name = self._held[:at].strip() if at >= 0 else None
        if at < 0:
            return False
        self._held = self._held[at + length:]
        self._json = JsonNesting()
        if self.parallel or not self.calls:
            self._call = ParsedCall(self.new_call_id(), self._name)
            self.calls.append(self._call)
            deltas.append(CallDelta(len(self.calls) - 1, self._call.id, self._name))
        else:
            self._call = None  # only one call may be made: later ones are read and dropped
        self._state = "args"
        return True

    def _partial(self, text: str, tag: str) -> int:
        """How many of `text`'s last characters may begin `tag`, written as text (0 where the
        vocabulary has it as a token)."""
        if tag not in self._as_text:
            return 0
        return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)

    def _may_be_name(self, args_at: int, id_at: int) -> bool:
        """Whether the held text is (or may still become) a call's name, ended by [ARGS] at
        `args_at` or [CALL_ID] at `id_at` (-1: not yet)."""
        ends = [i for i in (args_at, id_at) if i >= 0]
        name = (self._held[:min(ends)] if ends else self._held).strip()
        if ends:
            return _NAME.fullmatch(name) is not None
        for tag in (ARGS, CALL_ID):  # a tag's text may be arriving
            name = name[:len(name) - self._partial(name, tag)]
        return len(name) <= _NAME_MAX and _NAME_START.fullmatch(name) is not None

    def _read_args(self, deltas: list[CallDelta]) -> bool:
        """Arguments text up to where its object closes (JSON's strings, escapes and nesting)."""
        end = None
        for i, ch in enumerate(self._held):
            if ch == "\x00":  # a tag's token (never part of a string's text): the arguments end, unclosed
                end = i
                break
            if self._json.step(ch) == "}" and self._json.depth == 0:
                end = i + 1
                break
        piece = self._held if end is None else self._held[:end]
        piece = piece if self._call is None or self._call.arguments else piece.lstrip()
        if piece and self._call is not None:
            self._call.arguments += piece
            deltas.append(CallDelta(self.calls.index(self._call), arguments=piece))
        if end is None:
            self._held = ""
            return False
        if self._call is not None:
            self._call.complete = _is_object(self._call.arguments)
        self._held, self._state = self._held[end:], "between"
        return True


def _unmarked(text: str) -> str:
    """Text with any tag marks written back as the tags (a reply that mentions one as text)."""
    for tag, mark in _MARK.items():
        text = text.replace(mark, tag)
    return text


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def calls_grammar(markers: dict[str, str], tools: list[dict], parallel: bool, schema_text) -> str:
    """Lark rules `calls` (the first [TOOL_CALLS] and every call) and `first` (what follows it):
    each call a tool's name, [ARGS], and its arguments by the tool's schema. `markers`: each tag's
    lark (its token, or its text quoted); where it names [CALL_ID] (the template writes ids, as
    Mistral Small 3.2's does), a call may carry one, nine letters or digits, before [ARGS]."""
    call_id = f" ({markers[CALL_ID]} /[A-Za-z0-9]{{9}}/)?" if CALL_ID in markers else ""
    bodies, rules = [], []
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = function.get("parameters") if isinstance(function.get("parameters"), dict) else {"type": "object"}
        rules.append(f"tool{i}: {json.dumps(function['name'])}{call_id} {markers[ARGS]} %json {schema_text(schema)}")
        bodies.append(f"tool{i}")
    more = f" ({markers[TOOL_CALLS]} body)*" if parallel else ""
    return "\n".join([f"calls: {markers[TOOL_CALLS]} first", f"first: body{more}",
                      f"body: {' | '.join(bodies)}", *rules]) + "\n"
