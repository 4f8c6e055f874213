"""From a validated request to the sequences the leader runs: prompt token ids and
per-choice sampling parameters.

Runs in a worker thread (chat templates and tokenizing a long prompt take time
the event loop should not spend). Text is checked before it is tokenized: a lone
UTF-16 surrogate is a 400, and a text too long for the context whatever its
tokens is refused by its length alone, so no request tokenizes megabytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshllm.api import think
from meshllm.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from meshllm.api.tool_formats import ToolFormat, lark_marker
from meshllm.engine.grammar import Grammar, GrammarCompiler, schema_text
from meshllm.engine.sampler import SamplingParams
from meshllm.errors import BadRequest, ContextOverflow
from meshllm.model.tokenizer import Tokenizer

_SEED_RANGE = 1 << 63  # seeds travel as uint64 on the wire; keep them non-negative


@dataclass(frozen=True, slots=True)
class ChoiceRequest:
    """One sequence of a request: choice `index` continues prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    grammar: Grammar | None = None  # what the output must match (response_format, forced tool call)
    speculative: bool | None = None  # the request's override of the server's speculative decoding
    continues_prompt: bool = False  # legacy completions: the text goes on from the prompt's (its spacing kept)
    in_reasoning: bool = False  # chat: the prompt left a <think> block open, so the reply starts inside it


# Normalizers may fold a few characters into one (composed accents): allow for it, so
# the length check never refuses a prompt that would fit.
_NORMALIZER_SLACK = 2


def checked_text(tokenizer: Tokenizer, text: str, max_context: int, what: str) -> str:
    """`text`, once it is known to be valid Unicode and not certainly over the context."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{what} is not valid Unicode: it holds a lone UTF-16 surrogate "
                         f"(U+{ord(e.object[e.start]):04X}) at character {e.start}, as a client that splits an "
                         f"emoji or other character in two sends; send whole characters") from None
    at_least = len(text) // (tokenizer.max_token_chars * _NORMALIZER_SLACK)
    if at_least > max_context:
        raise ContextOverflow(f"{what} has {len(text)} characters, so at least {at_least} tokens; the context "
                              f"holds {max_context} tokens. Shorten the prompt")
    return text


@dataclass(frozen=True, slots=True)
class ModelText:
    """What turning requests into prompts needs of the served model (built once per model)."""

    tokenizer: Tokenizer
    max_context: int
    tool_format: ToolFormat
    grammars: GrammarCompiler
    thinks: bool = False  # its template speaks of a <think> block: replies are read for one (api/think.py)
    reasoning_marks: tuple[str, str] = ('"<think>"', '"</think>"')  # that block's tags in lark (their tokens
    # where the vocabulary has them)

    @classmethod
    def of(cls, tokenizer: Tokenizer, max_context: int) -> "ModelText":
        fmt = ToolFormat.of(tokenizer)
        thinks = fmt.harmony is None and think.CLOSE in (tokenizer.chat_template or "")
        return cls(tokenizer, max_context, fmt, GrammarCompiler(tokenizer), thinks,
                   (lark_marker(tokenizer, think.OPEN), lark_marker(tokenizer, think.CLOSE)))


def chat_choices(model: ModelText, body: ChatCompletionRequest) -> list[ChoiceRequest]:
    tokenizer = model.tokenizer
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    messages = [m.as_template_input() for m in body.messages]
    for i, message in enumerate(messages):
        for field in ("content", "name", "reasoning_content"):
            if field in message:
                checked_text(tokenizer, message[field], model.max_context, f"messages[{i}].{field}")
    final = messages[-1]["content"]
    messages, template_tools = model.tool_format.template_inputs(messages, tools)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.opens_turn, tools=template_tools,
                                         variables=body.chat_template_kwargs)
    if body.continue_final_message:
        text = _cut_after(text, final)
    text = checked_text(tokenizer, text, model.max_context, "the rendered chat")
    # A model's own template writes BOS itself where it wants one (transformers encodes the
    # rendered text without special tokens); the plain fallback template does not.
    ids = tokenizer.encode(text, add_special_tokens=tokenizer.chat_template is None)
    reasoning = None  # the reply reasons first: inside a block the prompt opened, or one it may open
    if model.thinks and not body.continue_final_message:
        reasoning = "opened" if think.prompt_opens_reasoning(text[-64:]) else "may_open"
    return _expand([ids], body, body.completion_limit, body.num_logprobs, model,
                   _chat_grammar(model, body, reasoning), continues_prompt=body.continue_final_message,
                   in_reasoning=reasoning == "opened")


def _cut_after(text: str, final: str) -> str:
    """The rendered chat up to the end of the final message's text: the template's end of turn
    after it goes, so the model goes on writing that message. As transformers cuts it
    (apply_chat_template's continue_final_message), trailing spaces a template trims included."""
    core = final.strip()
    at = text.rfind(core)
    if at < 0:
        raise BadRequest("continue_final_message: the model's chat template changes the last message's text, so "
                         "there is no place to continue it from")
    whole = final.lstrip()
    return text[:at + len(whole)] if text[at:at + len(whole)] == whole else text[:at + len(core)]


def _chat_grammar(model: ModelText, body: ChatCompletionRequest, reasoning: str | None = None) -> Grammar | None:
    """The grammar the reply must match: a forced tool call; else the response_format (or, with
    tools on auto, the response_format or a tool call); else none. `reasoning` "opened": the
    prompt left a reasoning block open; "may_open": the reply may open one first; either way the
    grammar holds from the block's end (think.after_reasoning)."""
    fmt = model.tool_format
    compiler = model.grammars if reasoning is None else _ReasoningFirst(model.grammars, model.reasoning_marks,
                                                                          reasoning == "opened")
    answer = None
    if body.response_format is not None and body.response_format.type == "json_object":
        answer, what = {"type": "object"}, "response_format json_object"
    elif body.response_format is not None and body.response_format.type == "json_schema":
        spec = body.response_format.json_schema
        answer, what = spec.json_schema, f"response_format json_schema {spec.name!r}"
    forced = body.forced_tools
    if forced is not None:
        tools = [t.model_dump(exclude_none=True) for t in forced]
        return compiler.lark(fmt.call_grammar(tools, body.parallel_calls),
                             f"tool_choice {', '.join(t.function.name for t in forced)}")
    if answer is None:
        return _strict_calls_grammar(model, body, compiler)
    if body.calls_tools:
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        return compiler.lark(fmt.call_grammar(tools, body.parallel_calls, answer), f"{what} or a tool call")
    wrapped = fmt.answer_grammar(answer)
    return compiler.json_schema(answer, what) if wrapped is None else compiler.lark(wrapped, what)


class _ReasoningFirst:
    """GrammarCompiler's lark and json_schema, each past a reasoning block (think.after_reasoning)."""

    def __init__(self, compiler: GrammarCompiler, marks: tuple[str, str], opened: bool):
        self.compiler, self.marks, self.opened = compiler, marks, opened

    def lark(self, text: str, description: str) -> Grammar:
        opening, close = self.marks
        return self.compiler.lark(think.after_reasoning(text, close, None if self.opened else opening), description)

    def json_schema(self, schema: dict, description: str) -> Grammar:
        return self.lark(f"start: %json {schema_text(schema)}", description)


def _strict_calls_grammar(model: ModelText, body: ChatCompletionRequest,
                          compiler: GrammarCompiler | _ReasoningFirst) -> Grammar | None:
    """With tool_choice auto and a function marked `strict`: free text or calls whose arguments match
    the strict functions' schemas (the others' arguments are any JSON object), as OpenAI's strict
    mode promises. None when no tool is strict (the model then writes calls unconstrained)."""
    if not body.calls_tools or not any(t.function.strict for t in body.tools):
        return None
    tools = [t.model_dump(exclude_none=True, exclude=None if t.function.strict else {"function": {"parameters"}})
             for t in body.tools]
    return compiler.lark(model.tool_format.text_or_call_grammar(tools, body.parallel_calls), "strict tools")


def completion_choices(model: ModelText, body: CompletionRequest) -> list[ChoiceRequest]:
    tokenizer = model.tokenizer
    prompts = body.prompts
    if not prompts:
        raise BadRequest("prompt is empty: give a string, a list of strings, or token ids")
    vocab = tokenizer.vocab_size
    all_ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            all_ids.append(tokenizer.encode(checked_text(tokenizer, prompt, model.max_context, f"prompt {i}")))
            continue
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} in the prompt is outside this model's vocabulary [0, {vocab})")
        all_ids.append(list(prompt))
    return _expand(all_ids, body, body.max_tokens, body.logprobs, model, continues_prompt=True)


def _logit_bias(body: SamplingFields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, bias in (body.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys are token ids, got {key!r}") from None
        if not 0 <= token_id < vocab_size:
            raise BadRequest(f"logit_bias token id {token_id} is outside this model's vocabulary [0, {vocab_size})")
        out.append((token_id, float(bias)))
    return tuple(out)


def _expand(prompts: list[list[int]], body: SamplingFields, max_tokens: int | None, logprobs: int | None,
            model: ModelText, grammar: Grammar | None = None, continues_prompt: bool = False,
            in_reasoning: bool = False) -> list[ChoiceRequest]:
    """n choices per prompt, OpenAI's order (prompt-major). Choice j gets seed base + j, so a
    request with a seed is reproducible and its choices still differ from one another. Without a
    seed each choice draws its own at the leader, which may then verify sampled drafts with
    min(1, p/q) (not bit-reproducible, exactly distributed)."""
    max_context = model.max_context
    logit_bias = _logit_bias(body, model.tokenizer.vocab_size)
    choices = []
    for prompt_index, ids in enumerate(prompts):
        if not ids:
            raise BadRequest(f"prompt {prompt_index} is empty: at least one token is needed")
        limit = max_tokens if max_tokens is not None else max_context - len(ids)
        if limit < 1:
            raise ContextOverflow(f"the prompt has {len(ids)} tokens, the whole context of {max_context} "
                                  f"tokens leaves no room for a completion; shorten the prompt")
        for j in range(body.n):
            params = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k_or_none,
                # No seed asked: the leader draws one per choice (and may then verify sampled drafts by p/q).
                seed=None if body.seed is None else (body.seed + j) % _SEED_RANGE, max_tokens=limit,
                stop=body.stop_strings, logprobs=logprobs, ignore_eos=body.ignore_eos, min_p=body.min_p or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0, presence_penalty=body.presence_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logit_bias=logit_bias)
            choices.append(ChoiceRequest(len(choices), prompt_index, ids, params, grammar, body.speculative,
                                         continues_prompt, in_reasoning))
    return choices
