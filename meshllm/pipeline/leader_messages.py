"""The leader loop's inbox: one small typed message per kind, posted from any thread and
handled on the loop thread (leader.py), and what the loop keeps per request and per step."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.scheduler import MicroBatch
from meshllm.engine.sequence import Sequence
from meshllm.engine.step import SampledToken, StepResult
from meshllm.engine.stopping import StopChecker
from meshllm.errors import MeshError
from meshllm.pipeline.events import GenerationEvent
from meshllm.pipeline.seq_constraints import SeqConstraints
from meshllm.pipeline.transport import IdleEnd

log = logging.getLogger(__name__)


@dataclass
class Request:
    seq: Sequence
    checker: StopChecker
    constraints: SeqConstraints
    on_event: Callable[[GenerationEvent], None]
    submitted_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_failovers: int = 0
    # Tokens whose text the stop checker still holds: their events wait for it (StopChecker.released).
    unreleased: list[SampledToken] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Submit:
    request: Request
    user_seeded: bool = False  # the caller chose the seed: output must be reproducible
    speculative: bool | None = None  # None: the leader's default (draft when it has a proposer)
    max_draft: int | None = None  # cap on draft tokens per step for this request
    done: threading.Event = field(default_factory=threading.Event)
    refused: list[MeshError] = field(default_factory=list)  # set by the loop when admission fails

    def refuse(self, error: MeshError) -> None:
        if not self.done.is_set():
            self.refused.append(error)
            self.done.set()


@dataclass(frozen=True, slots=True)
class Cancel:
    seq_id: SeqId


@dataclass(frozen=True, slots=True)
class StepDone:
    step_id: int
    result: StepResult


@dataclass(frozen=True, slots=True)
class Wake:
    pass


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """The transport's stream ended while idle (transport.IdleEnd): a stage failed, no step says which."""

    transport: object  # the StepTransport it happened on: ignored once that one is replaced
    end: IdleEnd


@dataclass(frozen=True, slots=True)
class InFlight:
    batch: MicroBatch
    sent_at: float
    epoch: int  # of the transport when sent: a later one means the stages lost what this step computed
    # Another micro-batch was in flight when this one was sent: its round trip then includes
    # waiting behind that one on a stage, so what its rows cost is its busiest stage's compute.
    overlapped: bool = False


def notify_failed(request: Request, error: MeshError) -> None:
    """Tell a request's caller it ended with `error`, bypassing state that may be broken."""
    seq = request.seq
    try:
        request.on_event(GenerationEvent(seq.seq_id, "", finish_reason="error", error=error,
                                         num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached))
    except Exception:  # noqa: BLE001 - one broken callback must not stop the others from hearing
        log.exception("request %d: its event callback failed", seq.seq_id)
