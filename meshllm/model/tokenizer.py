"""Text <-> token ids, and chat messages -> prompt text, matching transformers.

A `Tokenizer` wraps a `tokenizers.Tokenizer` built from a model folder's
tokenizer.json, or from a GGUF file's vocabulary (rebuilt the way transformers'
GGUF converter rebuilds it, so token ids match). Chat templates render in a sandboxed
jinja2 environment set up the way transformers sets it up, so a template from
the Hub produces the same prompt here as there.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import (AddedToken, Regex, Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers,
                        processors)

from meshllm.errors import BadRequest, ModelLoadError
from meshllm.model.token_bytes import gpt2_byte_alphabet, strips_leading_space, vocabulary_bytes

if TYPE_CHECKING:
    from meshllm.model.gguf import GGUFFile

log = logging.getLogger(__name__)

# For models without a chat template: readable, and the model continues after "assistant:".
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encode, decode and render chat prompts. Thread-safe for concurrent encode/decode."""

    def __init__(self, backend: Backend, *, special_tokens: dict[str, str | None],
                 eos_token_ids: tuple[int, ...], chat_template: str | None):
        self.backend = backend
        self.special_tokens = special_tokens  # bos_token, eos_token, ... as text, for templates
        self.chat_template = chat_template  # None: the model has none, PLAIN_CHAT_TEMPLATE is used
        self._eos_token_ids = eos_token_ids
        bos = special_tokens.get("bos_token")
        self._bos_token_id = backend.token_to_id(bos) if bos is not None else None
        self._template = _compile(chat_template or PLAIN_CHAT_TEMPLATE)

    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        """From a Hugging Face folder: tokenizer.json, tokenizer_config.json, generation_config.json."""
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{file} not found: meshllm needs a model folder with tokenizer.json "
                                 f"(the 'fast' tokenizer format)")
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:  # tokenizers raises bare Exception on parse errors
            raise ModelLoadError(f"{file} cannot be loaded: {e}") from None
        config = _read_json(folder / "tokenizer_config.json")
        special = {name: _token_text(config.get(name)) for name in _TEMPLATE_TOKENS}
        _keep_whole(backend, special)
        # tokenizer.json's post-processor decides whether BOS/EOS are added, as in transformers 5;
        # add_bos_token/add_eos_token only count when it has none.
        if backend.post_processor is None:
            _set_bos_eos(backend, special, config.get("add_bos_token", False), config.get("add_eos_token", False))
        eos_ids = [backend.token_to_id(special["eos_token"])] if special["eos_token"] else []
        generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        eos_ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
        return cls(backend, special_tokens=special, chat_template=_folder_chat_template(folder, config),
                   eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)))

    @classmethod
    def from_gguf(cls, gguf: "GGUFFile | str | Path") -> "Tokenizer":
        """From the vocabulary, merges and chat template stored in a GGUF file's metadata."""
        from meshllm.model.gguf import GGUFFile, without_harmony_end  # GGUF support loads only when needed

        file = gguf if isinstance(gguf, GGUFFile) else GGUFFile.open(gguf)
        meta = file.metadata
        backend = _gguf_backend(file)
        tokens = meta["tokenizer.ggml.tokens"]

        def token_at(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        no_bos = meta.get("tokenizer.ggml.pre") in _NO_BOS_PRE
        special = {"bos_token": None if no_bos else token_at("bos_token_id"), "eos_token": token_at("eos_token_id"),
                   "unk_token": token_at("unknown_token_id"), "pad_token": token_at("padding_token_id")}
        _keep_whole(backend, special)
        # llama.cpp's default: sentencepiece vocabularies add BOS unless the file says otherwise.
        by_default = meta.get("tokenizer.ggml.model") == "llama" or meta.get("tokenizer.ggml.pre") in _WHOLE_WORD_PRE
        add_bos = not no_bos and bool(meta.get("tokenizer.ggml.add_bos_token", by_default))
        _set_bos_eos(backend, special, add_bos, bool(meta.get("tokenizer.ggml.add_eos_token", False)))
        # Generation ends at EOS and at the end-of-turn tokens llama.cpp knows about.
        eos_ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                          "tokenizer.ggml.eom_token_id") if k in meta]
        eos_ids += [i for i, t in enumerate(tokens) if t in _END_OF_GENERATION]
        eos_ids = without_harmony_end(eos_ids, tokens)
        return cls(backend, special_tokens=special, chat_template=meta.get("tokenizer.chat_template"),
                   eos_token_ids=tuple(dict.fromkeys(eos_ids)))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def token_bytes(self) -> tuple[bytes, ...]:
        """The raw bytes of each token id (a piece of a UTF-8 character for some tokens)."""
        return vocabulary_bytes(self.backend)

    @functools.cached_property
    def strips_leading_space(self) -> bool:
        """Decoding drops the space that begins a text (so the first token adds one byte less)."""
        return strips_leading_space(self.backend)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while Rust works (encode holds it): a long prompt
        # tokenized on a worker thread then leaves the server's event loop free.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for (the longest vocabulary
        string), so a text of n characters has at least n / max_token_chars tokens."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> "DecodeStream":
        """`context`: ids the text continues (the prompt's last few), which only set its spacing."""
        return DecodeStream(self, skip_special_tokens, context)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]); `tools` (OpenAI
        function definitions) go to the template as transformers passes them; `variables` are
        more for the template (a request's chat_template_kwargs, such as enable_thinking), which
        never replace the ones set here.

        Raises BadRequest when the template rejects the conversation (e.g. roles that do not
        alternate): that is the caller's input, and the template's message says what is wrong.
        """
        if messages and messages[0].get("role") == "system" and not self._takes_system_role:
            messages = _system_in_first_user_turn(messages)
        try:
            return self._render(messages, add_generation_prompt, tools, variables)
        except jinja2.TemplateError as e:
            raise BadRequest(f"the model's chat template rejected these messages: {e}") from None
        except TypeError as e:  # e.g. a message whose content is not text, for the plain template
            raise BadRequest(f"the messages do not fit the model's chat template: {e}") from None

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
                variables: dict | None) -> str:
        # JSON round trips: the template sees plain data, as transformers' does
        context = {**json.loads(json.dumps(variables or {})),
                   **{name: text for name, text in self.special_tokens.items() if text is not None},
                   "messages": json.loads(json.dumps(messages)),
                   "tools": json.loads(json.dumps(tools)) if tools else None,
                   "documents": None, "add_generation_prompt": add_generation_prompt}
        return self._template.render(**context)

    @functools.cached_property
    def _takes_system_role(self) -> bool:
        """Whether the template renders a system message. Gemma 2's and Mistral v0.2's refuse one
        (raise_exception); clients send one anyway, and llama.cpp's server and ollama then put
        it at the start of the first user turn (minja's polyfill), as apply_chat_template does."""
        probe = [{"role": "system", "content": _PROBES[0]}, {"role": "user", "content": _PROBES[1]}]
        try:
            text = self._render(probe, True, None, None)
        except (jinja2.TemplateError, TypeError):
            return False
        return _PROBES[0] in text or _PROBES[1] not in text  # not dropped where the user's text shows


_PROBES = ("meshllm-system-probe", "meshllm-user-probe")


def _system_in_first_user_turn(messages: list[dict]) -> list[dict]:
    """A leading system message's text put before the first user message's (or, with none, the
    system message as the user's); the rest as it was. Content that is not text stays apart."""
    system, rest = messages[0], messages[1:]
    if not isinstance(system.get("content"), str):
        return messages
    first_user = next((i for i, m in enumerate(rest) if m.get("role") == "user"), None)
    if first_user is None or not isinstance(rest[first_user].get("content"), str):
        return [{**system, "role": "user"}, *rest]
    merged = {**rest[first_user], "content": f"{system['content']}\n\n{rest[first_user]['content']}"}
    return [*rest[:first_user], merged, *rest[first_user + 1:]]


class DecodeStream:
    """Incremental detokenizer: feed ids one at a time, get text deltas.

    Never returns half a UTF-8 character: while a multi-byte character is split over tokens,
    `step` returns "" until the character is complete. One stream per sequence; not thread-safe.
    """

    # The tokenizers library's own DecodeStream raises on byte sequences that are not valid
    # UTF-8 (a sampled byte-fallback token can start one), so this keeps a window instead:
    # decode the ids since the last emitted boundary and emit what is new once it does not
    # end in a replacement character, or once MAX_HELD ids are waiting (invalid bytes then
    # come out as U+FFFD, as in a full decode).
    MAX_HELD = 8

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context: Sequence[int] = ()):
        """`context`: ids the text continues. Their text is not emitted; the first token's text is
        then what it adds after them, so a sentencepiece word keeps the space before it that a
        decode drops at the start of a text ("is" + "▁Paris": " Paris", not "Paris")."""
        self._backend = tokenizer.backend
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context)
        self._prefix_offset = 0  # ids before this only give context for spacing
        self._read_offset = len(self._ids)  # text of ids before this has been emitted

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        emitted = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        waiting = len(self._ids) - self._read_offset
        if len(text) > len(emitted) and (not text.endswith("\ufffd") or waiting >= self.MAX_HELD):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return text[len(emitted):]
        return ""

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip) if ids else ""


def _keep_whole(backend: Backend, special: dict[str, str | None]) -> None:
    # As transformers does: named special tokens are added tokens, so they are never split and
    # skip_special_tokens drops them.
    added = {str(t.content) for t in backend.get_added_tokens_decoder().values()}
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in dict.fromkeys(special.values()) if t is not None and t not in added])


def _set_bos_eos(backend: Backend, special: dict[str, str | None], add_bos: bool, add_eos: bool) -> None:
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    tokens = [(t, backend.token_to_id(t)) for t, used in ((bos, add_bos), (eos, add_eos)) if used]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    return value if isinstance(value, dict) else {}


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens as "text" or {"content": "text", ...}
    return value.get("content") if isinstance(value, dict) else value


def _folder_chat_template(folder: Path, config: dict) -> str | None:
    # Newer transformers save the template beside the config; older ones inside it.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` (assistant-mask markers) and
    renders the body unchanged: we never need the mask, but templates using it must still parse."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _compile(template: str) -> jinja2.Template:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: jinja's own tojson escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # Templates come from downloaded files: sandboxed, as in transformers.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template does not parse (line {e.lineno}): {e.message}") from None


# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4
# tokenizer.ggml.pre -> the split regexes its merges were learned with, applied one after the
# other (each splits the pieces of the one before), as llama.cpp's llama-vocab.cpp lists them;
# others use GPT-2's. Checked against llama.cpp's own reference tokenizations
# (tests/model/test_llama_cpp_vocabs.py).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+",)
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
# o200k (GPT-4o's, Phi-4-mini's, Llama 4's): tokenizer.json's regex, as llama.cpp lists it first
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
# GLM-4's (llama.cpp's CHATGLM4): Llama 3's, its contractions spelled out in both cases
_GLM4_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2_SPLIT)  # every digit a piece of its own, then GPT-2's split
_DEEPSEEK_CODER_SPLIT = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
                         r"\p{N}")
_PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                         "falcon3": _LLAMA3_SPLIT, "pixtral": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
                         "dbrx": _LLAMA3_SPLIT,
                         "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "stablelm2": _QWEN2_SPLIT,
                         "qwen35": _QWEN35_SPLIT, "tekken": _TEKKEN_SPLIT,
                         "gpt-4o": _GPT4O_SPLIT, "llama4": _GPT4O_SPLIT, "kanana2": _GPT4O_SPLIT,
                         "talkie": _GPT4O_SPLIT, "minimax-m2": _GPT4O_SPLIT,
                         "glm4": _GLM4_SPLIT, "glm5": _GLM4_SPLIT, "chatglm-bpe": _GLM4_SPLIT,
                         "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
                         "command-r": _DIGITS_THEN_GPT2, "codeshell": _DIGITS_THEN_GPT2,
                         "exaone": _DIGITS_THEN_GPT2, "minerva-7b": _DIGITS_THEN_GPT2,
                         "deepseek-coder": _DEEPSEEK_CODER_SPLIT}

# llama.cpp's Llama 3 family of pre-tokenizers (and Mistral's tekken): a word that is a whole token
# is that token (the BPE "ignore_merges"), and BOS is added unless the file says otherwise.
_WHOLE_WORD_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken"})
# GLM's: llama.cpp adds no BOS whatever the file says, and glm4's keeps whole-token words too
_NO_BOS_PRE = frozenset({"chatglm-bpe", "glm4", "glm5"})
_IGNORE_MERGES_PRE = _WHOLE_WORD_PRE | {"glm4", "glm5"}
# Tokens llama.cpp ends generation at whatever the metadata names (a Llama 3 Instruct file
# converted with only eos = <|end_of_text|> still stops at <|eot_id|>).
_END_OF_GENERATION = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>",
                                "<\uff5cend\u2581of\u2581sentence\uff5c>"})


def _gguf_backend(file: "GGUFFile") -> Backend:
    """A tokenizers.Tokenizer from GGUF metadata, built as transformers' GGUF converter builds it."""
    meta = file.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{file.path} has no tokenizer.ggml.tokens: it carries no vocabulary")
    token_types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [])]
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges", []), meta.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        backend = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"), meta.get("tokenizer.ggml.merges"),
                                     bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    else:
        raise ModelLoadError(f"{file.path} has a {kind!r} tokenizer; meshllm builds 'gpt2' (byte-level BPE) "
                             f"and 'llama' (sentencepiece BPE) tokenizers from GGUF")
    # Control tokens (<|im_end|>) stay whole and are special; user-defined ones (<think>) stay whole.
    # A control token outside the byte alphabet in a byte-level vocabulary is a llama.cpp mislabel.
    alphabet = set(gpt2_byte_alphabet().values()) if kind == "gpt2" else None
    control = [AddedToken(t, special=True, normalized=False) for t, kind_ in zip(tokens, token_types)
               if kind_ == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, kind_ in zip(tokens, token_types)
                        if kind_ == _USER_DEFINED and t in vocab])
    return backend


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Backend:
    spelling = gpt2_byte_alphabet()
    alphabet = set(spelling.values())
    # Tokens written with raw characters (an added "\n\n") are re-spelled in the byte alphabet.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                                 continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                 ignore_merges=pre in _IGNORE_MERGES_PRE))
    splits = _PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None and pre not in (None, "default", "gpt2", "gpt-2"):
        log.warning("tokenizer pre-type %r is not one meshllm knows: splitting text as GPT-2 does, which may "
                    "give other token ids than llama.cpp for some texts", pre)
    if splits is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], scores, merges: list[str] | None, add_space_prefix: bool) -> Backend:
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ")) for m in merges]
    else:  # sentencepiece files store scores, not merges: rank every split of a token by its score
        pairs = _merges_from_scores(vocab, dict(zip(tokens, (float(s) for s in scores))))
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    # Spaces as "\u2581" and, with add_space_prefix (as llama.cpp reads it), one more before each
    # piece of text between special tokens: what sentencepiece, llama.cpp and the models' own
    # tokenizer.json do. Metaspace's "first" scheme prepended only at the very start, and not
    # before text that already began with a space: "<s>[INST]" encoded "[" where Llama 2 and
    # Mistral were trained on "\u2581[".
    replace = normalizers.Replace(" ", "\u2581")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_space_prefix \
        else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if add_space_prefix else []))
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    # transformers' generate_merges: best-scoring merged token first, ties by piece lengths.
    merges = []
    for merged, score in scores.items():
        local = [(merged[:i], merged[i:], score) for i in range(1, len(merged))
                 if merged[:i] in vocab and merged[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
