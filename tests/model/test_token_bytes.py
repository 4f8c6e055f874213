"""Raw token bytes: joining the bytes of a text's tokens gives back the text's UTF-8 bytes,
also where one character (an emoji, CJK) spans several byte-level or byte-fallback tokens."""

from __future__ import annotations

import pytest

from meshllm.model.tokenizer import Tokenizer

TEXTS = ["Hello world", "héllo wörld — naïve café", "日本語のテキスト, Ελληνικά, русский",
         "🎉🦀 emoji 👩‍👩‍👧 and flags 🇫🇷", "  two  spaces\nnew line\n\n\ttab",
         "{\"key\": [1, 2.5, null]}"]


def _joined(tokenizer: Tokenizer, text: str) -> bytes:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return b"".join(tokenizer.token_bytes[i] for i in ids)


@pytest.mark.slow
def test_byte_level_bpe_tokens_join_to_the_text(smollm2_gguf_path):
    tokenizer = Tokenizer.from_gguf(smollm2_gguf_path)
    assert len(tokenizer.token_bytes) == tokenizer.vocab_size
    assert not tokenizer.strips_leading_space
    for text in TEXTS:
        assert _joined(tokenizer, text) == text.encode(), text
    # some tokens of an emoji are not valid UTF-8 on their own: that is why bytes are needed
    emoji_ids = tokenizer.encode("🦀", add_special_tokens=False)
    assert len(emoji_ids) > 1 and any(not _is_utf8(tokenizer.token_bytes[i]) for i in emoji_ids)
    assert tokenizer.token_bytes[tokenizer.eos_token_ids[0]] == b"<|im_end|>"  # special tokens are their text


def test_sentencepiece_byte_fallback_tokens_join_to_the_text(aidreams_path):
    tokenizer = Tokenizer.from_folder(aidreams_path)  # 512 tokens: most non-ASCII falls back to bytes
    assert tokenizer.strips_leading_space
    for text in TEXTS:
        # sentencepiece writes a space before the text, which decoding strips again
        assert _joined(tokenizer, text) == b" " + text.encode(), text
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.token_bytes[tokenizer.backend.token_to_id("<0xF0>")] == b"\xf0"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
