"""Tool calls out of a model's output, as it streams: content deltas, and per call its id and
name once the name is complete, then its arguments text as it grows (OpenAI's stream shape).

Text that might begin a call (a partial `<tool_call>`) is held back until the next tokens
decide. Arguments stream as the raw JSON text of the call's arguments value: a small
JSON-aware scanner (strings, escapes, nesting) finds where that value ends, so the
deltas joined are exactly the `arguments` a non-streamed reply carries.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tool_formats imports harmony, which takes this module's call shapes
    from meshllm.api.tool_formats import ToolFormat

# A call object's head, up to the first character of its arguments value.
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass(frozen=True, slots=True)
class CallDelta:
    index: int
    id: str | None = None  # set (with name) on a call's first delta
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""  # raw JSON text of the arguments value
    complete: bool = False


@dataclass
class JsonNesting:
    """Where a JSON text stands, one character at a time: its bracket depth, and whether it is
    inside a string (just after a backslash there)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def step(self, c: str) -> str | None:
        """Take character `c`: '"' when it ends a string, "}" when it closes a bracket (the depth
        then one less), else None."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                return '"'
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            return "}"
        return None


@dataclass
class _CallScan:
    """One call object being read: its text so far and where its arguments value is."""

    text: str = ""
    nesting: JsonNesting = field(default_factory=JsonNesting)
    scanned: int = 0
    args_start: int | None = None
    args_end: int | None = None  # one past the value's last character, once known
    closed_at: int | None = None  # one past the object's closing brace
    call: ParsedCall | None = None
    sent: int = 0  # characters of the arguments already streamed


class CallReader:
    """What the readers of a reply's tool calls share (this module's JSON families', the tag forms'):
    the content so far, the calls, and held text that the next text decides, stepped through by
    each reader's own `_step` (False: more text is needed)."""

    def __init__(self, parallel: bool, forced: bool):
        """`forced`: a grammar makes the reply calls only (tool_choice required or named)."""
        self.parallel, self.forced = parallel, forced
        self.content: list[str] = []
        self.calls: list[ParsedCall] = []
        self._held = ""  # text not yet known to be content or call
        self._state = "content"

    @property
    def text(self) -> str:
        return "".join(self.content)

    def feed(self, text: str, token_id: int | None = None) -> tuple[str, list[CallDelta]]:
        """(content to stream, call deltas) that `text` (the token `token_id`'s text) adds."""
        before = len(self.content)
        deltas: list[CallDelta] = []
        self._opening_token(token_id)
        self._held += text
        while self._held and self._step(deltas):
            pass
        return "".join(self.content[before:]), deltas

    def _opening_token(self, token_id: int | None) -> None:
        """A family whose calls open with a special token (no text) sees it here."""

    def _step(self, deltas: list[CallDelta]) -> bool:
        raise NotImplementedError

    def _emit(self, text: str) -> str:
        if text:
            self.content.append(text)
        return text


class ToolCallParser(CallReader):
    """Per choice; fed on the event loop in token order. States: content (looking for a call's
    opening), calls (between or inside call objects), closing (hermes: expecting </tool_call>),
    between (hermes: whitespace after a block)."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True, forced: bool = False):
        super().__init__(parallel, forced)
        self.fmt = fmt
        self._scan: _CallScan | None = None

    def _opening_token(self, token_id: int | None) -> None:
        if token_id is not None and token_id == self.fmt.begin_token and self._state == "content":
            self._emit(self._held)
            self._held, self._state = "", "calls"

    def finish(self, cut: bool = False) -> str:
        """Content still held at the end (text that never became a call).

        `cut`: the reply stopped at its token limit. Markup it stopped inside is then no content:
        a call's head before its name was complete (a call with a name is reported with the
        arguments it got, as OpenAI reports a cut call), or, in a forced reply, part of the
        opening marker. A reply that ended by itself inside a call's head keeps that text as
        content: the model chose to stop there, and the text shows what it wrote."""
        if cut and (self._state != "content" or self.forced):
            self._held, self._scan = "", None
            return ""
        rest = self._held if self._state not in ("closing", "between") else ""
        if self._scan is not None and self._scan.call is None:
            rest = self._scan.text + rest
        self._held, self._scan = "", None
        return self._emit(rest)

    def _step(self, deltas: list[CallDelta]) -> bool:
        """Consume what the held text decides; False when more text is needed."""
        if self._state == "content":
            return self._find_opening()
        if self._state == "closing":
            return self._read_closing()
        if self._state == "between":  # whitespace between hermes blocks is no content
            self._held = self._held.lstrip()
            if self._held:
                self._state = "content"
            return bool(self._held)
        return self._read_call(deltas)

    def _find_opening(self) -> bool:
        held = self._held
        if self.fmt.family == "llama3":  # a call is the whole reply: it starts with "{"
            stripped = held.lstrip()
            if not stripped:
                return False
            if not self.content and stripped.startswith("{"):
                self._state = "calls"
                return True
            self._emit(held)
            self._held = ""
            return False
        marker = self.fmt.begin_text
        at = held.find(marker)
        if at >= 0:
            self._emit(held[:at])
            self._held, self._state = held[at + len(marker):], "calls"
            return True
        keep = next((n for n in range(min(len(marker) - 1, len(held)), 0, -1) if held.endswith(marker[:n])), 0)
        self._emit(held[:len(held) - keep])
        self._held = held[len(held) - keep:]
        return False

    def _read_closing(self) -> bool:
        stripped = self._held.lstrip()
        if not stripped:
            return False
        if stripped.startswith("</tool_call>"):
            self._held, self._state = stripped[len("</tool_call>"):], "between"
            return True
        if "</tool_call>".startswith(stripped):
            return False
        self._state = "content"  # no closing tag: whatever follows is content again
        return True

    def _read_call(self, deltas: list[CallDelta]) -> bool:
        if self._scan is None:
            # Between calls: whitespace and the separators of the family's list form.
            start = next((i for i, c in enumerate(self._held) if not (c.isspace() or c in "[,;]")), None)
            if start is None:
                self._held = ""
                return False
            if self._held[start] != "{":
                self._state = "content"  # not a call after all
                self._held = self._held[start:]
                return True
            self._held, self._scan = self._held[start:], _CallScan()
        scan = self._scan
        scan.text += self._held
        self._held = ""
        _advance(scan)
        if scan.call is None:
            match = _NAME.match(scan.text)
            if match is None:
                if scan.closed_at is not None:  # a whole object that is no call: content
                    self._held, self._scan, self._state = scan.text, None, "content"
                    self._emit(self._held)
                    self._held = ""
                return False
            self._start_call(scan, _json_string(match.group(1)), match.end(), deltas)
        if scan.call.id:
            end = scan.args_end if scan.args_end is not None else len(scan.text)
            new = scan.text[scan.args_start + scan.sent:end]
            if new:
                scan.sent += len(new)
                scan.call.arguments += new
                deltas.append(CallDelta(self.calls.index(scan.call), arguments=new))
        if scan.closed_at is None:
            return False
        scan.call.complete = True
        self._held, self._scan = scan.text[scan.closed_at:], None
        if self.fmt.family == "hermes":
            self._state = "closing"
        return True

    def _start_call(self, scan: _CallScan, name: str, args_start: int, deltas: list[CallDelta]) -> None:
        if not self.parallel and self.calls:
            scan.call = ParsedCall("", name)  # only one call may be made: later ones are read and dropped
        else:
            scan.call = ParsedCall(self.fmt.new_call_id(), name)
            self.calls.append(scan.call)
            deltas.append(CallDelta(len(self.calls) - 1, scan.call.id, scan.call.name))
        # rescan from the arguments value, now that its start is known
        scan.args_start = scan.scanned = args_start
        scan.nesting = JsonNesting(depth=1)
        scan.args_end = scan.closed_at = None
        _advance(scan)


def _json_string(body: str) -> str:
    """A JSON string's value from its text between the quotes; a model may write an invalid
    escape or a raw control character there: then the text as written."""
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return body


def _advance(scan: _CallScan) -> None:
    """Scan new characters: track nesting; mark where the arguments value and the object end."""
    text = scan.text
    i = scan.scanned
    while i < len(text) and scan.closed_at is None:
        ended, depth = scan.nesting.step(text[i]), scan.nesting.depth
        open_args = scan.args_start is not None and scan.args_end is None
        if ended == '"' and open_args and depth == 1:
            scan.args_end = i + 1  # a string-valued arguments field ends here
        elif ended == "}":
            if open_args and depth <= 1:
                # the value closed (depth 1), or the object closed around a bare value (depth 0)
                scan.args_end = i + 1 if depth == 1 else len(text[:i].rstrip())
            if depth == 0:
                scan.closed_at = i + 1
        i += 1
    scan.scanned = i
