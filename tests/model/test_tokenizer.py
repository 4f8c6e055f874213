"""Tokenizer ids, decoding, streaming and chat templates against transformers on the same files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from gguf import GGUFWriter
from transformers import AutoTokenizer

from meshllm.errors import BadRequest, ModelLoadError
from meshllm.model.tokenizer import PLAIN_CHAT_TEMPLATE, Tokenizer

TEXTS = [
    "Hello world",
    "",
    " leading space, trailing space ",
    "  two  spaces\nnew line\n\n\ttab",
    "héllo wörld — naïve café, 日本語のテキスト, 🎉🦀 emoji",
    "It's 2024; we'll see... 12345 + 3.14159 = ?",
    "<|im_start|>user\nhi<|im_end|>",
    "<s> x </s> a<|endoftext|>b",
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there, ça va? 🎉"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


def _assert_same_as(ours: Tokenizer, reference) -> None:
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == reference.encode(
                text, add_special_tokens=special), (text, special)
        ids = reference.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


# ---------------------------------------------------------------- GGUF byte-level BPE (SmolLM2)

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf_path):
    return AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)


@pytest.mark.slow
def test_smollm2_gguf_tokens_match_transformers(smollm2, smollm2_reference):
    _assert_same_as(smollm2, smollm2_reference)
    assert smollm2.bos_token_id == smollm2_reference.bos_token_id == 1
    # <|im_end|> from the metadata, and <|endoftext|>, which llama.cpp ends generation at too
    assert smollm2.eos_token_ids == (smollm2_reference.eos_token_id, 0) == (2, 0)


@pytest.mark.slow
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smollm2, smollm2_reference, generation_prompt):
    for messages in (CONVERSATION, CONVERSATION[1:2]):  # with and without a system message
        assert smollm2.apply_chat_template(messages, add_generation_prompt=generation_prompt) == \
            smollm2_reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def test_smollm2_gguf_basics(smollm2):
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = smollm2.encode(prompt)
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|>, <|im_end|> stay whole
    assert smollm2.decode(ids) == "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging " \
                                  "Face\nuser\nHi\nassistant\n"
    assert smollm2.decode(ids, skip_special_tokens=False) == prompt


# ---------------------------------------------------------------- folders (tokenizer.json)

@pytest.fixture(scope="module")
def aidreams_reference(aidreams_path):
    return AutoTokenizer.from_pretrained(aidreams_path)


def test_folder_tokens_match_transformers(aidreams_path, aidreams_reference):
    ours = Tokenizer.from_folder(aidreams_path)
    _assert_same_as(ours, aidreams_reference)
    assert ours.encode("hi")[0] == ours.bos_token_id == 1  # add_bos_token: true
    assert ours.eos_token_ids == (2,)


def _folder_with(tmp_path: Path, aidreams_path: Path, **config) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir(parents=True)
    shutil.copy(aidreams_path / "tokenizer.json", folder)
    base = json.loads((aidreams_path / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return folder


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system message must come first') }}{% endif %}"
    "[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
    "{{ {'who': 'ça'} | tojson }}{{ strftime_now('%Y') | length }}"
)


def test_folder_chat_template_renders_like_transformers(tmp_path, aidreams_path):
    folder = _folder_with(tmp_path, aidreams_path, chat_template=TEMPLATE, add_bos_token=False)
    ours, reference = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    for generation_prompt in (True, False):
        assert ours.apply_chat_template(CONVERSATION, generation_prompt) == reference.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=generation_prompt)
    assert '{"who": "ça"}4' in ours.apply_chat_template(CONVERSATION)  # tojson keeps non-ASCII, like transformers
    _assert_same_as(ours, reference)  # tokenizer.json's post-processor (adds BOS) wins over add_bos_token
    with pytest.raises(BadRequest, match="system message must come first"):
        ours.apply_chat_template(CONVERSATION[1:] + CONVERSATION[:1])


# google/gemma-2-2b-it's template (Mistral v0.2's refuses a system message the same way)
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


def test_a_system_message_goes_into_the_first_user_turn_where_the_template_refuses_one(tmp_path, aidreams_path):
    # as llama.cpp's server and ollama render it (minja's polyfill): clients send a system prompt
    # to every model, and Gemma 2 refused it with a 400
    refuses = Tokenizer.from_folder(_folder_with(tmp_path / "g", aidreams_path, chat_template=GEMMA2_TEMPLATE))
    system = {"role": "system", "content": "Answer briefly."}
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"role": "user", "content": "Why?"}]
    assert refuses.apply_chat_template([system, *turns]) == refuses.apply_chat_template(
        [{"role": "user", "content": "Answer briefly.\n\nHi"}, *turns[1:]])
    assert "<start_of_turn>user\nAnswer briefly.<end_of_turn>" in refuses.apply_chat_template([system])
    with pytest.raises(BadRequest, match="roles must alternate"):  # its other rules still hold
        refuses.apply_chat_template([system, turns[0], turns[2]])
    takes = Tokenizer.from_folder(_folder_with(tmp_path / "t", aidreams_path, chat_template=TEMPLATE))
    assert "[SYSTEM] Answer briefly." in takes.apply_chat_template([system, *turns])  # left as it is


def test_chat_template_sources_and_fallback(tmp_path, aidreams_path):
    plain = Tokenizer.from_folder(aidreams_path)  # aidreams has no template
    assert plain.chat_template is None
    assert plain.apply_chat_template(CONVERSATION[:2]) == "system: Be brief.\nuser: Hi there, ça va? 🎉\nassistant:"
    assert plain.apply_chat_template(CONVERSATION[:2], add_generation_prompt=False).endswith("🎉\n")

    named = _folder_with(tmp_path, aidreams_path, chat_template=[
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{% generation %}D{% endgeneration %}"}])
    assert Tokenizer.from_folder(named).apply_chat_template(CONVERSATION) == "D"
    (named / "chat_template.jinja").write_text("J{{ messages | length }}")  # newer transformers save it here
    assert Tokenizer.from_folder(named).apply_chat_template(CONVERSATION) == "J4"
    assert PLAIN_CHAT_TEMPLATE  # the fallback is public for the API docs


def test_add_bos_token_applies_when_tokenizer_json_has_no_post_processor(tmp_path, aidreams_path):
    for add_bos in (True, False):
        folder = _folder_with(tmp_path / str(add_bos), aidreams_path, add_bos_token=add_bos)
        spec = json.loads((folder / "tokenizer.json").read_text())
        spec["post_processor"] = None
        (folder / "tokenizer.json").write_text(json.dumps(spec))
        ours, reference = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
        # transformers 5 drops add_bos_token here and never adds BOS; we follow the config, as
        # transformers 4's Llama tokenizers did. The ids after BOS are the same.
        for text in TEXTS:
            assert ours.encode(text) == [1] * add_bos + reference.encode(text)


def test_eos_ids_include_generation_config(tmp_path, aidreams_path):
    folder = _folder_with(tmp_path, aidreams_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_folder(folder).eos_token_ids == (2, 0)


def test_folder_errors(tmp_path, aidreams_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path / "missing")
    broken = _folder_with(tmp_path, aidreams_path, chat_template="{% for m in messages %}")
    with pytest.raises(ModelLoadError, match="chat template does not parse"):
        Tokenizer.from_folder(broken)
    (broken / "tokenizer_config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        Tokenizer.from_folder(broken)
    (broken / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ModelLoadError, match="cannot be loaded"):
        Tokenizer.from_folder(broken)


# ---------------------------------------------------------------- GGUF sentencepiece BPE ("llama")

def _sentencepiece_gguf(path: Path, aidreams_path: Path, with_merges: bool) -> Path:
    """aidreams' 512-piece vocabulary written as llama.cpp writes a sentencepiece vocabulary."""
    model = json.loads((aidreams_path / "tokenizer.json").read_text())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    w = GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    # llama_token_type: 2 unknown, 3 control, 6 byte, 1 normal
    w.add_token_types([2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else 1
                       for t in tokens])
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    if with_merges:
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("with_merges", [True, False], ids=["merges", "scores"])
def test_sentencepiece_gguf_matches_the_models_own_tokenizer(tmp_path, aidreams_path, with_merges):
    # The reference is the model's own tokenizer.json (sentencepiece's rule: a "\u2581" before
    # each piece of text between special tokens, also before one starting with a space), as
    # llama.cpp encodes. transformers' GGUF converter prepends only at the very start and not
    # before a leading space: " Hello" gave [15043] on Llama 2, where sentencepiece and llama.cpp
    # give [29871, 15043], and "<s>[INST]" encoded "[" instead of "\u2581[".
    path = _sentencepiece_gguf(tmp_path / "sp.gguf", aidreams_path, with_merges)
    ours = Tokenizer.from_gguf(path)
    _assert_same_as(ours, AutoTokenizer.from_pretrained(aidreams_path))
    assert ours.encode("hi")[0] == 1  # llama.cpp adds BOS to sentencepiece vocabularies by default
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>x"


def test_gguf_without_vocabulary_is_a_clear_error(tmp_path):
    w = GGUFWriter(tmp_path / "nv.gguf", "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="no tokenizer.ggml.tokens"):
        Tokenizer.from_gguf(tmp_path / "nv.gguf")


# ---------------------------------------------------------------- streaming detokenizer

@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_decode_stream_emits_whole_characters(source, smollm2_gguf_path, aidreams_path):
    tokenizer = Tokenizer.from_gguf(smollm2_gguf_path) if source == "gguf" else Tokenizer.from_folder(aidreams_path)
    text = "Voilà: 日本語 and 🦀🎉 — done.\nNext line"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = tokenizer.decode_stream()
    deltas = [stream.step(i) for i in ids]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some emoji/kanji span several tokens: nothing is emitted until they are whole


@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_a_decode_stream_continuing_a_prompt_emits_exactly_what_follows_its_text(source, smollm2_gguf_path,
                                                                                 aidreams_path):
    # Seeded with the prompt's last ids, a stream's text is what the whole decode adds after the
    # prompt's: sentencepiece (aidreams) keeps the space before the first word, which a stream
    # that starts a text drops; byte-level BPE (SmolLM2) is the same either way.
    tokenizer = Tokenizer.from_gguf(smollm2_gguf_path) if source == "gguf" else Tokenizer.from_folder(aidreams_path)
    prompt = tokenizer.encode("Once upon a time, in 日本", add_special_tokens=False)
    for text in (" there was a crab 🦀.", "s of old", " 語 and more"):
        ids = tokenizer.encode("Once upon a time, in 日本" + text, add_special_tokens=False)[len(prompt):]
        stream = tokenizer.decode_stream(context=prompt[-4:])
        continued = "".join(stream.step(i) for i in ids)
        assert continued == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]
        assert continued.startswith(" ") == text.startswith(" "), (continued, text)
        alone = tokenizer.decode_stream()
        assert "".join(alone.step(i) for i in ids) == tokenizer.decode(ids)


# ---------------------------------------------------------------- GGUF Llama 3 family ("llama-bpe")

def _byte_level_gguf(path: Path, pre: str, tokens: list[str], merges: list[str], bos: int, eos: int,
                     add_bos: bool | None = None) -> Path:
    """A vocabulary-only GGUF of a byte-level BPE tokenizer; tokens in <...> are control tokens."""
    w = GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama3_style_gguf(path: Path, add_bos: bool | None) -> Path:
    """A byte-level vocabulary as llama.cpp writes Llama 3's: pre "llama-bpe", EOS <|end_of_text|>
    and no end-of-turn key (as some converted Instruct files have), "abc" a whole token that no
    merge reaches."""
    tokens = ["a", "b", "c", "ab", "abc", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    return _byte_level_gguf(path, "llama-bpe", tokens, ["a b"], bos=5, eos=6, add_bos=add_bos)


def test_llama3_family_vocabularies_encode_and_stop_as_llama_cpp_does(tmp_path):
    # Checked against llama.cpp's own reference (models/ggml-vocab-llama-bpe.gguf.inp/.out: 46 of
    # 46 texts the same ids; before, "Cửa Việt" and others split where a whole token exists).
    ours = Tokenizer.from_gguf(_llama3_style_gguf(tmp_path / "l3.gguf", add_bos=None))
    assert ours.encode("abc") == [5, 4]  # BOS by default, as llama.cpp adds it for this family; one token
    assert ours.encode("ab", add_special_tokens=False) == [3]
    assert set(ours.eos_token_ids) == {6, 7}  # <|eot_id|> ends a turn whatever the metadata names
    assert Tokenizer.from_gguf(_llama3_style_gguf(tmp_path / "nobos.gguf", add_bos=False)).encode("abc") == [4]


def test_harmony_vocabularies_end_at_return_or_call_not_at_end(tmp_path):
    # GPT-OSS (o200k_harmony): a reply is messages, each closed by <|end|> (its reasoning first);
    # it ends at <|return|>, or <|call|> for a tool call, as llama.cpp stops it
    tokens = ["a", "b", "ab", "<|start|>", "<|end|>", "<|message|>", "<|return|>", "<|call|>"]
    ours = Tokenizer.from_gguf(_byte_level_gguf(tmp_path / "h.gguf", "gpt-4o", tokens, ["a b"], bos=3, eos=6,
                                                add_bos=False))
    assert set(ours.eos_token_ids) == {6, 7}
    # without <|call|> (Phi-4-mini's o200k), <|end|> still ends a turn
    phi = Tokenizer.from_gguf(_byte_level_gguf(tmp_path / "p.gguf", "gpt-4o", tokens[:-1], ["a b"], bos=3, eos=6,
                                               add_bos=False))
    assert set(phi.eos_token_ids) == {4, 6}


def test_tekken_vocabularies_split_as_mistral_nemo_does(tmp_path):
    # Mistral Nemo's GGUFs name pre "tekken" (it fell back to GPT-2's split, with a warning): its
    # split (llama.cpp's llama-vocab.cpp, from the model's tokenizer.json) breaks a word before an
    # upper-case letter that follows lower-case ones and every digit apart; a piece that is a whole
    # token is that token, and BOS comes first by default, as llama.cpp sets for tekken.
    tokens = ["H", "e", "l", "o", "W", "r", "d", "1", "2", "Hello", "World", "HelloWorld", "12", "<s>", "</s>"]
    path = _byte_level_gguf(tmp_path / "tekken.gguf", "tekken", tokens, ["1 2"], bos=13, eos=14)
    ours = Tokenizer.from_gguf(path)
    hello, world = tokens.index("Hello"), tokens.index("World")
    assert ours.encode("HelloWorld") == [13, hello, world]  # GPT-2's split: [13, "HelloWorld"]
    assert ours.encode("12", add_special_tokens=False) == [tokens.index("1"), tokens.index("2")]  # GPT-2: "12"
    assert ours.encode("Hello", add_special_tokens=False) == [hello]  # whole, though no merges reach it
