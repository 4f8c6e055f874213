"""What rank 0 tells the other ranks of its group, as one flat int64 tensor.

Workers mirror rank 0 exactly: before computing a step, rank 0 broadcasts it (its
sequences with their positions, prefix blocks and drafts; releases, publishes and
evictions; the input ids or hidden states), so every rank runs the same step on its
own slices and KV cache. Each step and release names the stream (owner) it came on and
the plan's limit on sequences held, so every rank refuses or applies it alike, and when a
stream ends every rank frees what that owner held (ReleaseOwner). Release commands mirror
the stage's Release calls, heartbeats keep idle workers from timing out, and shutdown ends them.

A step command carries what the workers compute from, nothing more (`worker_view`):
sampling inputs (parameters, penalty counts, allowed-token masks, draft distributions)
stay with rank 0, which alone samples, and timings stay with the stage that reports them.

Layout: [MAGIC, kind, num_meta, meta..., payload...]; the meta words are small
integers read with one `tolist()`, the payload is the step input's raw bytes viewed as
int64 (no per-element conversion). Unsigned 64-bit ids travel as their two's complement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum

import torch
from torch import Tensor

from meshllm.engine.kv_cache import LOCAL_OWNER, Owner, SeqId
from meshllm.engine.logit_processors import PenaltyCounts
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.step import Publish, SeqWork, Step
from meshllm.errors import BadRequest, MalformedMessage

MAGIC = 0x6D65736854500001  # "meshTP", format 1
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.int64: 4, torch.int32: 5}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
# Scored rows must carry seeded parameters (SeqWork's rule); a worker computes them but never samples.
UNSAMPLED = SamplingParams(temperature=0.0, seed=0)


class Kind(IntEnum):
    HEARTBEAT = 0
    STEP = 1
    RELEASE = 2
    SHUTDOWN = 3
    RELEASE_OWNER = 4


_NONE = -1  # an absent owner or limit (owners and limits are never negative)


@dataclass(frozen=True, slots=True)
class RunStep:
    step: Step
    owner: Owner = LOCAL_OWNER  # the stream the step came on (StageRunner.run)
    max_held: int | None = None  # the plan's batch: a step leaving the owner holding more is refused


@dataclass(frozen=True, slots=True)
class Release:
    seq_ids: tuple[SeqId, ...]
    owner: Owner | None = None  # only what this owner holds; None: whoever holds them


@dataclass(frozen=True, slots=True)
class ReleaseOwner:
    """A stream ended: free every sequence and prefix block its owner held."""

    owner: Owner


@dataclass(frozen=True, slots=True)
class Heartbeat:
    pass


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Command = RunStep | Release | ReleaseOwner | Heartbeat | Shutdown


def worker_view(step: Step) -> Step:
    """`step` as a worker receives it: what it computes from (see the module docstring)."""
    seqs = tuple(replace(w, sampling=UNSAMPLED if w.num_scored else None, penalties=PenaltyCounts(), allowed=(),
                         draft_dists=None) for w in step.seqs)
    return replace(step, seqs=seqs, timings=())


def encode(command: Command) -> Tensor:
    """The command as int64 words [n]."""
    meta: list[int] = []
    payload = torch.empty(0, dtype=torch.int64)
    match command:
        case RunStep(step=step, owner=owner, max_held=max_held):
            kind = Kind.STEP
            meta += [owner, _NONE if max_held is None else max_held]
            payload = _encode_step(step, meta)
        case Release(seq_ids=seq_ids, owner=owner):
            kind = Kind.RELEASE
            meta.append(_NONE if owner is None else owner)
            _put_list(meta, [_i64(s) for s in seq_ids])
        case ReleaseOwner(owner=owner):
            kind = Kind.RELEASE_OWNER
            meta.append(owner)
        case Heartbeat():
            kind = Kind.HEARTBEAT
        case Shutdown():
            kind = Kind.SHUTDOWN
        case _:
            raise TypeError(f"not a command: {command!r}")
    head = torch.tensor([_i64(MAGIC), int(kind), len(meta), *meta], dtype=torch.int64)
    return torch.cat((head, payload)) if payload.numel() else head


def decode(words: Tensor) -> Command:
    """Inverse of `encode` up to `worker_view`; raises MalformedMessage on anything else (a
    desynchronised stream)."""
    if words.dtype != torch.int64 or words.dim() != 1 or words.numel() < 3:
        raise MalformedMessage(f"tensor-parallel command must be int64 words, got {words.dtype}{list(words.shape)}")
    magic, kind, num_meta = words[:3].tolist()
    if _u64(magic) != MAGIC or not 0 <= num_meta <= words.numel() - 3:
        raise MalformedMessage("tensor-parallel command stream out of step (bad magic or length)")
    meta = _Reader(words[3:3 + num_meta].tolist())
    payload = words[3 + num_meta:]
    try:
        match Kind(kind):
            case Kind.STEP:
                owner, max_held = _owner(meta.one()), meta.one()
                command = RunStep(_decode_step(meta, payload), owner, None if max_held == _NONE else
                                  _non_negative(max_held))
            case Kind.RELEASE:
                owner = meta.one()
                command = Release(tuple(SeqId(_u64(s)) for s in meta.list()), None if owner == _NONE else
                                  _owner(owner))
            case Kind.RELEASE_OWNER:
                command = ReleaseOwner(_owner(meta.one()))
            case Kind.HEARTBEAT:
                command = Heartbeat()
            case Kind.SHUTDOWN:
                command = Shutdown()
    except (IndexError, KeyError, ValueError, RuntimeError, BadRequest) as e:
        raise MalformedMessage(f"malformed tensor-parallel command: {e}") from None
    if not meta.done():
        raise MalformedMessage("tensor-parallel command has trailing words")
    return command


def _non_negative(value: int) -> int:
    if value < 0:
        raise ValueError(f"negative count {value}")
    return value


def _owner(value: int) -> Owner:
    return Owner(_non_negative(value))


def _encode_step(step: Step, meta: list[int]) -> Tensor:
    meta += [step.step_id, step.block_size, len(step.seqs)]
    for w in step.seqs:
        meta += [_i64(w.seq_id), w.start, w.num_tokens, w.num_scored]
        _put_list(meta, [_i64(h) for h in w.attach])
        _put_list(meta, list(w.draft))
    _put_list(meta, [_i64(s) for s in step.release])
    meta.append(len(step.publish))
    for p in step.publish:
        meta += [_i64(p.seq_id), p.first_block]
        _put_list(meta, [_i64(h) for h in p.hashes])
    _put_list(meta, [_i64(h) for h in step.evict])
    x = step.input.contiguous()
    if x.dtype not in DTYPE_CODES:
        raise MalformedMessage(f"step input of dtype {x.dtype} cannot be mirrored; expected one of {list(DTYPE_CODES)}")
    raw = x.view(torch.uint8).reshape(-1) if x.numel() else torch.empty(0, dtype=torch.uint8)
    meta += [DTYPE_CODES[x.dtype], x.dim(), *x.shape, raw.numel()]
    padded = torch.nn.functional.pad(raw, (0, (-raw.numel()) % 8)) if raw.numel() % 8 else raw
    return padded.view(torch.int64)


def _decode_step(meta: _Reader, payload: Tensor) -> Step:
    step_id, block_size, num_seqs = meta.take(3)
    seqs = []
    for _ in range(num_seqs):
        seq_id, start, num_tokens, num_scored = meta.take(4)
        attach = tuple(_u64(h) for h in meta.list())
        draft = tuple(meta.list())
        seqs.append(SeqWork(SeqId(_u64(seq_id)), start, num_tokens, num_scored, UNSAMPLED if num_scored else None,
                            attach, draft))
    release = tuple(SeqId(_u64(s)) for s in meta.list())
    publish = []
    for _ in range(meta.one()):
        seq_id, first_block = meta.take(2)
        publish.append(Publish(SeqId(_u64(seq_id)), first_block, tuple(_u64(h) for h in meta.list())))
    evict = tuple(_u64(h) for h in meta.list())
    dtype, ndim = DTYPES[meta.one()], meta.one()
    shape, num_bytes = meta.take(ndim), meta.one()
    if num_bytes > payload.numel() * 8 or payload.numel() != -(-num_bytes // 8):
        raise MalformedMessage(f"step input claims {num_bytes} bytes, the command holds {payload.numel() * 8}")
    raw = payload.view(torch.uint8)[:num_bytes]
    x = raw.view(dtype).reshape(shape).clone()  # own memory: the receive buffer is reused
    return Step(step_id, tuple(seqs), x, release, (), tuple(publish), evict, block_size)


def _put_list(meta: list[int], values: list[int]) -> None:
    meta.append(len(values))
    meta.extend(values)


class _Reader:
    def __init__(self, values: list[int]):
        self.values, self.pos = values, 0

    def take(self, n: int) -> list[int]:
        if n < 0 or self.pos + n > len(self.values):
            raise IndexError(f"command ends after {len(self.values)} words, wanted {self.pos + n}")
        out = self.values[self.pos:self.pos + n]
        self.pos += n
        return out

    def one(self) -> int:
        return self.take(1)[0]

    def list(self) -> list[int]:
        return self.take(self.one())

    def done(self) -> bool:
        return self.pos == len(self.values)


def _i64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _u64(value: int) -> int:
    return value + (1 << 64) if value < 0 else value
