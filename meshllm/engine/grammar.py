"""Grammar-constrained decoding at the leader, on llguidance.

`response_format` (json_object, json_schema) and forced tool calls become a grammar;
each constrained sequence gets a `Matcher` that the leader advances by every committed
token and asks, before each step, for the bitmask of tokens allowed next. The last
stage masks the logits with it before it picks (logit_processors.py), so the sampler
only ever picks a token the grammar allows, and the grammar only ever allows EOS once
the document is complete.

Why llguidance (bench/grammar.py, SmolLM2's 49152-token vocabulary, a nested schema,
CPU): ~20-35 us per token for mask + advance, ~2 ms to compile a schema, no
dependencies beyond its own wheel, Lark grammars with embedded JSON schemas and
special tokens (tool-call wrappers), and rollback (speculative drafts). xgrammar was
faster per token (~3-5 us) but pulls transformers and triton into the runtime;
outlines-core compiles regexes (~160 ms for the same schema) and has no CFG.

Speculation: `accept_draft` advances along draft tokens and stops at the first one the
grammar rejects (the draft is truncated there); `rollback` undoes what verification
did not accept.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import llguidance
import numpy as np

from meshllm.errors import BadRequest
from meshllm.model.tokenizer import Tokenizer

# Separators as models write JSON in their training data; no free whitespace, so a small
# model cannot wander into an endless run of newlines inside a document.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_ROLLBACK_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Grammar:
    """An llguidance grammar (serialized), checked against the served vocabulary."""

    text: str
    description: str  # for errors: "json_schema 'weather'", "tool call to get_weather"


class GrammarCompiler:
    """Builds and checks grammars for one tokenizer. Thread-safe (HTTP worker threads compile,
    the leader thread makes matchers). The llguidance tokenizer takes ~0.3 s to build for a
    50k vocabulary, so it is built on first use, once."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                t = self._tokenizer
                self._lltokenizer = llguidance.LLTokenizer(t.backend.to_str(), n_vocab=t.vocab_size,
                                                           eos_token=list(t.eos_token_ids))
            return self._lltokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    def json_schema(self, schema: dict, description: str = "json_schema") -> Grammar:
        if not isinstance(schema, dict):
            raise BadRequest(f"{description}: the schema must be a JSON object, got {type(schema).__name__}")
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(_styled(schema, description))
        except ValueError as e:  # e.g. a lone surrogate in a string: not JSON llguidance can read
            raise BadRequest(f"{description}: {e}") from None
        return self._checked(text, description)

    def json_object(self) -> Grammar:
        return self.json_schema({"type": "object"}, "json_object")

    def lark(self, text: str, description: str) -> Grammar:
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        except ValueError as e:
            raise BadRequest(f"{description}: {e}") from None
        return self._checked(grammar, description)

    def _checked(self, text: str, description: str) -> Grammar:
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.lltokenizer)
        if error:
            raise BadRequest(f"{description} cannot be enforced: {messages[0]}; use JSON Schema features "
                             f"llguidance supports (types, properties, required, enum, const, items, anyOf, "
                             f"$ref, string patterns)")
        return Grammar(text, description)

    def matcher(self, grammar: Grammar) -> "Matcher":
        return Matcher(llguidance.LLMatcher(self.lltokenizer, grammar.text, log_level=0), self.vocab_size,
                       grammar.description, frozenset(self._tokenizer.eos_token_ids))


class Matcher:
    """The grammar state of one sequence. Not thread-safe: the leader's loop thread owns it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, description: str,
                 stop_ids: frozenset[int] = frozenset()):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.description = description
        self.num_words = (vocab_size + 31) // 32
        self.stop_ids = stop_ids  # the tokenizer's EOS ids, which llguidance allows once a document is complete

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token it did not allow was committed), or None."""
        return self._matcher.get_error() or None if self._matcher.is_error() else None

    @property
    def is_accepting(self) -> bool:
        """The text so far is a complete document (EOS is allowed)."""
        return self._matcher.is_accepting()

    @property
    def is_stopped(self) -> bool:
        """Nothing but EOS can follow."""
        return self._matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """int32 [ceil(vocab / 32)]: bit i of word j allows token 32 j + i next."""
        words = np.zeros(self.num_words, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        return words

    def stopped_mask(self) -> np.ndarray:
        """allowed() after a stop token: only the stop tokens (what llguidance allows then)."""
        words = np.zeros(self.num_words, dtype=np.uint32)
        for token_id in self.stop_ids:
            if token_id < self.vocab_size:
                words[token_id // 32] |= np.uint32(1 << (token_id % 32))
        return words.view(np.int32)

    def accept(self, token_id: int) -> bool:
        """Advance by a committed token; False (and the matcher in error) if the grammar forbids it."""
        return self._matcher.consume_token(token_id)

    def accept_draft(self, draft: list[int]) -> int:
        """Advance along the longest prefix of `draft` the grammar allows; returns its length."""
        return self._matcher.try_consume_tokens(list(draft))

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens <= MAX_ROLLBACK_TOKENS, num_tokens
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._matcher.get_error()}")


def allows(words: np.ndarray, token_id: int) -> bool:
    """Whether the mask allows the token; ids past the mask (a model vocabulary wider than the
    tokenizer's, or a proposer's bad id) never are."""
    return 0 <= token_id < 32 * len(words) and bool((int(words[token_id // 32]) >> (token_id % 32)) & 1)


def schema_text(schema: dict, description: str = "json_schema") -> str:
    """A schema as one line of JSON, for embedding in a Lark grammar (`%json {...}`)."""
    return json.dumps(_styled(schema, description))


def _styled(schema: dict, description: str) -> dict:
    """The schema with our JSON layout (JSON_STYLE) under any llguidance options it sets itself."""
    own = schema.get("x-guidance", {})
    if not isinstance(own, dict):
        raise BadRequest(f"{description}: x-guidance must be an object of llguidance options, "
                         f"got {type(own).__name__}")
    return {**schema, "x-guidance": {**JSON_STYLE, **own}}
