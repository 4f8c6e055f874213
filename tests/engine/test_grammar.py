"""Grammar matchers (llguidance) on real vocabularies: masks allow exactly the tokens that keep
the document valid, random walks through the mask always end in a document that validates,
drafts stop at the first rejected token, and rollback restores the state."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from meshllm.engine.grammar import GrammarCompiler, allows
from meshllm.errors import BadRequest
from meshllm.model.source import open_model
from meshllm.model.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "role": {"enum": ["admin", "viewer"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                  "ok": {"type": "boolean"}},
                 "required": ["city", "ok"], "additionalProperties": False},
    },
    "required": ["name", "role", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["aidreams", "smollm2"])
def tokenizer(request, aidreams_path) -> Tokenizer:
    if request.param == "smollm2":
        return Tokenizer.from_gguf(request.getfixturevalue("smollm2_gguf_path"))
    return open_model(aidreams_path).tokenizer


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text` as generated text (without the space sentencepiece puts before a text)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[1:] if tokenizer.token_bytes[ids[0]] == b" " else ids


def _walk(compiler: GrammarCompiler, tokenizer: Tokenizer, seed: int, max_steps: int = 400) -> list[int]:
    """Pick uniformly among allowed tokens until only EOS is left (EOS taken once allowed, half the time)."""
    rng = random.Random(seed)
    matcher = compiler.matcher(compiler.json_schema(SCHEMA))
    eos = set(tokenizer.eos_token_ids)
    ids = []
    for _ in range(max_steps):
        words = matcher.allowed()
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:tokenizer.vocab_size]
        choices = [int(i) for i in np.flatnonzero(bits)]
        assert choices, "the grammar must always allow some token"
        if eos & set(choices) and (len(choices) == len(eos & set(choices)) or rng.random() < 0.5):
            return ids
        assert not matcher.is_accepting or any(t not in eos for t in choices)
        token = rng.choice([c for c in choices if c not in eos])
        assert matcher.accept(token), matcher.error
        ids.append(token)
    raise AssertionError(f"no complete document after {max_steps} tokens")


def test_random_walks_through_the_mask_are_valid_documents(tokenizer):
    compiler = GrammarCompiler(tokenizer)
    for seed in range(8):
        ids = _walk(compiler, tokenizer, seed)
        document = json.loads(b"".join(tokenizer.token_bytes[i] for i in ids).decode())
        jsonschema.validate(document, SCHEMA)


def test_mask_follows_a_valid_document_and_allows_eos_only_at_its_end(tokenizer):
    compiler = GrammarCompiler(tokenizer)
    matcher = compiler.matcher(compiler.json_schema(SCHEMA))
    text = json.dumps({"name": "Ada", "role": "admin", "home": {"city": "Paris", "ok": True}})
    ids = _ids(tokenizer, text)
    eos = tokenizer.eos_token_ids[0]
    for token in ids:
        words = matcher.allowed()
        assert allows(words, token) and not allows(words, eos)
        assert matcher.accept(token)
    assert matcher.is_accepting and allows(matcher.allowed(), eos)
    # a token that breaks the schema is masked out, and committing it anyway is an error
    matcher = compiler.matcher(compiler.json_schema(SCHEMA))
    bad = _ids(tokenizer, '{"name": "Ada", "zzz": 1}')
    first_bad = next(i for i, token in enumerate(bad)
                     if not allows(matcher.allowed(), token) or not matcher.accept(token))
    assert tokenizer.decode(bad[:first_bad + 1]).startswith('{"name": "Ada", "')
    assert not matcher.accept(bad[first_bad]) and matcher.error


def test_draft_stops_at_the_first_rejected_token_and_rollback_restores(tokenizer):
    compiler = GrammarCompiler(tokenizer)
    matcher = compiler.matcher(compiler.json_schema(SCHEMA))
    good = _ids(tokenizer, '{"name": "Ada", "role": "admin"')
    bad = tokenizer.encode(' oops', add_special_tokens=False)
    before = matcher.allowed()
    assert matcher.accept_draft(good[:3]) == 3
    after_three = matcher.allowed()
    assert matcher.accept_draft(good[3:] + bad) == len(good) - 3  # stops where the draft goes wrong
    assert matcher.error is None
    matcher.rollback(len(good) - 3)
    assert np.array_equal(matcher.allowed(), after_three)
    matcher.rollback(3)
    assert np.array_equal(matcher.allowed(), before)


def test_unsupported_schema_is_a_clear_bad_request(aidreams_path):
    compiler = GrammarCompiler(open_model(aidreams_path).tokenizer)
    with pytest.raises(BadRequest, match="cannot be enforced"):
        compiler.json_schema({"type": "object", "properties": {"a": {"type": "wizard"}}})
    with pytest.raises(BadRequest, match="must be a JSON object"):
        compiler.json_schema(["not", "a", "schema"])
