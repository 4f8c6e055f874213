"""Whole (non-streaming) replies: wait for every choice to finish, then answer once."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshllm.api.choices import ChoiceState, LogprobFormatter, usage
from meshllm.api.generation import Generation
from meshllm.api.responses import (AssistantMessage, ChatChoice, ChatCompletion, Completion, CompletionChoice,
                                   ResponseFunction, ResponseToolCall, new_id, now)


@dataclass(frozen=True, slots=True)
class ReplyContext:
    """What every chunk or reply of one request repeats."""

    id: str
    model: str
    formatter: LogprobFormatter
    wants_logprobs: bool
    created: int = field(default_factory=now)

    @classmethod
    def new(cls, prefix: str, model: str, formatter: LogprobFormatter, wants_logprobs: bool) -> "ReplyContext":
        return cls(new_id(prefix), model, formatter, wants_logprobs)


async def collect(generation: Generation, states: list[ChoiceState]) -> None:
    """Feed every event into its choice; the first failed sequence fails the request."""
    async for index, event in generation.events():
        error = states[index].add(event)
        if error is not None:
            generation.cancel()
            raise error


def assistant_message(state: ChoiceState) -> AssistantMessage:
    content = "".join(state.text)
    if not state.tool_calls:
        return AssistantMessage(content=content, reasoning_content=state.reasoning)
    calls = [ResponseToolCall(id=c.id, function=ResponseFunction(name=c.name, arguments=c.arguments))
             for c in state.tool_calls]
    return AssistantMessage(content=content if content.strip() else None, tool_calls=calls,
                            reasoning_content=state.reasoning)


def chat_completion(states: list[ChoiceState], ctx: ReplyContext) -> ChatCompletion:
    f = ctx.formatter
    choices = [ChatChoice(index=s.request.index, message=assistant_message(s),
                          logprobs=f.chat(s.logprobs, f.cursor(s.request.continues_prompt))
                          if ctx.wants_logprobs else None,
                          finish_reason=s.finish_reason)
               for s in states]
    return ChatCompletion(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices, usage=usage(states))


def completion(states: list[ChoiceState], ctx: ReplyContext) -> Completion:
    f = ctx.formatter
    choices = [CompletionChoice(index=s.request.index, text="".join(s.text),
                                logprobs=f.completion(s.logprobs, f.cursor(s.request.continues_prompt))
                                if ctx.wants_logprobs else None,
                                finish_reason=s.finish_reason)
               for s in states]
    return Completion(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices, usage=usage(states))
