"""The raw bytes of every token of a vocabulary.

Decoding one token alone gives U+FFFD for a token that holds part of a multi-byte
UTF-8 character (an emoji is often 2-4 byte-level tokens), so logprob `bytes`
and grammar matchers need each token's bytes instead. They follow from the
tokenizer's decoder: byte-level BPE spells bytes in GPT-2's printable alphabet;
sentencepiece writes a space as U+2581 and unknown bytes as `<0xAB>` tokens.
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer as Backend

from meshllm.errors import ModelLoadError

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map above U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    extra = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def _decoder_kinds(spec: dict | None) -> list[dict]:
    if spec is None:
        return []
    return [d for s in spec.get("decoders", []) for d in _decoder_kinds(s)] if spec["type"] == "Sequence" else [spec]


def vocabulary_bytes(backend: Backend) -> tuple[bytes, ...]:
    """bytes of token id i at index i, for every id below the vocabulary size (added tokens
    included: they are their own text). Ids with no token get b""."""
    spec = json.loads(backend.to_str())
    decoders = _decoder_kinds(spec.get("decoder"))
    kinds = {d["type"] for d in decoders}
    added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    size = backend.get_vocab_size(with_added_tokens=True)
    out = [b""] * size
    if "ByteLevel" in kinds:
        inverse = {c: b for b, c in gpt2_byte_alphabet().items()}

        def spell(token: str) -> bytes:
            return bytes(inverse[c] for c in token) if all(c in inverse for c in token) else token.encode()
    elif "ByteFallback" in kinds or "Replace" in kinds:
        replace = [(d["pattern"].get("String", ""), d["content"]) for d in decoders if d["type"] == "Replace"]

        def spell(token: str) -> bytes:
            match = _BYTE_TOKEN.match(token)
            if match is not None and "ByteFallback" in kinds:
                return bytes([int(match.group(1), 16)])
            for pattern, content in replace:
                token = token.replace(pattern, content)
            return token.encode()
    elif not decoders or kinds <= {"Fuse", "Strip"}:
        def spell(token: str) -> bytes:
            return token.encode()
    else:
        raise ModelLoadError(f"cannot tell the bytes of tokens for a tokenizer whose decoder is {sorted(kinds)}; "
                             f"meshllm knows byte-level BPE and sentencepiece (byte fallback) decoders")
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if 0 <= token_id < size:
            out[token_id] = token.encode() if token in added else spell(token)
    return tuple(out)


def strips_leading_space(backend: Backend) -> bool:
    """True when decoding drops the space that begins a text (sentencepiece's `Strip` decoder
    after the U+2581 prefix): the first token of a decoded text then adds one byte less."""
    kinds = _decoder_kinds(json.loads(backend.to_str()).get("decoder"))
    return any(d["type"] == "Strip" and d.get("content") == " " and d.get("start", 0) > 0 for d in kinds)
