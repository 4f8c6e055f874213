"""Protobuf <-> dataclasses for the pipeline's Stage service, converted once, here.

Everything decoded here came from a peer: counts, positions and sampling
parameters are checked before they reach the engine.
"""

from __future__ import annotations

import torch

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.logit_processors import PenaltyCounts
from meshllm.engine.sampler import SamplingParams, TokenLogprobs
from meshllm.engine.step import (MAX_DRAFT_SUPPORT, DraftDist, Publish, SampledToken, SeqWork, StageTiming, Step,
                                 StepResult)
from meshllm.engine.step_limits import WIRE_LIMITS, WIRE_MAX_BLOCK_SIZE, WIRE_MAX_LIST, StepLimits
from meshllm.errors import BadRequest, MalformedMessage, PlanLimitExceeded, ShardUnavailable
from meshllm.tp.group import DEFAULT_TIMEOUT_S, RankRole
from meshllm.transport import codec
from meshllm.transport.protos import stage_pb2
from meshllm.transport.token_mask import MAX_MASK_WORDS, mask_from_bytes, mask_to_bytes

MAX_TP_SIZE = 64  # ranks of one tensor-parallel group
MAX_DRAFT_TOKENS = 64  # a verification step scores at most this many proposed tokens per sequence
# Allowed-token masks one step may inflate to, in all: a leader's worst case is ~133 MB (64
# sequences x 65 scored rows x a 256k vocabulary); without it a step under the wire's limits (a
# LoadRequest without limits) could make a stage inflate 4096 x 65 masks of 128 KiB, 34 GB.
MAX_STEP_MASK_BYTES = 256 << 20
_NO_INPUT = codec.to_pb(torch.zeros(0, dtype=torch.int64))  # a step of chores only: no rows


def scored_rows_fit(num_scored: int, num_draft: int, num_tokens: int) -> bool:
    """A draft is always scored whole (plus the row before it); without one, at most the last row is."""
    expected = (num_draft + 1,) if num_draft else (0, 1)
    return num_scored in expected and num_scored <= num_tokens


def sampling_to_pb(p: SamplingParams) -> stage_pb2.SamplingParams:
    msg = stage_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, seed=p.seed or 0, min_p=p.min_p,
                                   frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                                   bias_ids=[t for t, _ in p.logit_bias], bias_values=[b for _, b in p.logit_bias])
    if p.top_k is not None:
        msg.top_k = p.top_k
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    return msg


def sampling_from_pb(m: stage_pb2.SamplingParams) -> SamplingParams:
    if len(m.bias_ids) != len(m.bias_values):
        raise MalformedMessage(f"logit_bias has {len(m.bias_ids)} token ids but {len(m.bias_values)} values")
    try:
        return SamplingParams(temperature=m.temperature, top_p=m.top_p,
                              top_k=m.top_k if m.HasField("top_k") else None, seed=m.seed,
                              logprobs=m.logprobs if m.HasField("logprobs") else None, min_p=m.min_p,
                              frequency_penalty=m.frequency_penalty, presence_penalty=m.presence_penalty,
                              repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
                              logit_bias=tuple(zip(m.bias_ids, m.bias_values)))
    except BadRequest as e:
        raise MalformedMessage(f"bad sampling parameters from peer: {e}") from None


def _penalties_from_pb(e: stage_pb2.SeqEntry, limits: StepLimits) -> PenaltyCounts:
    # A sequence has at most as many distinct tokens as positions.
    if len(e.penalty_ids) != len(e.penalty_counts) or len(e.penalty_ids) > limits.max_context:
        raise MalformedMessage(f"sequence {e.seq_id}: {len(e.penalty_ids)} penalty ids, {len(e.penalty_counts)} "
                               f"counts")
    if any(t < 0 for t in e.penalty_ids) or any(c < 0 for c in e.penalty_counts) \
            or len(set(e.penalty_ids)) != len(e.penalty_ids):
        raise MalformedMessage(f"sequence {e.seq_id}: penalty ids must be distinct and counts non-negative")
    return PenaltyCounts(tuple(e.penalty_ids), tuple(e.penalty_counts))


def step_to_pb(plan_id: str, step: Step, leader_id: str = "") -> stage_pb2.StepRequest:
    return stage_pb2.StepRequest(
        plan_id=plan_id, step_id=step.step_id, leader_id=leader_id,
        seqs=[stage_pb2.SeqEntry(seq_id=w.seq_id, start=w.start, num_tokens=w.num_tokens, num_scored=w.num_scored,
                                 sampling=sampling_to_pb(w.sampling) if w.sampling else None, attach=w.attach,
                                 draft=w.draft, penalty_ids=w.penalties.ids, penalty_counts=w.penalties.counts,
                                 allowed=[mask_to_bytes(m.numpy()) for m in w.allowed],
                                 draft_dists=[stage_pb2.DraftDist(ids=d.ids, probs=d.probs)
                                              for d in w.draft_dists or ()])
              for w in step.seqs],
        input=codec.to_pb(step.input), release=step.release,
        timings=[timing_to_pb(t) for t in step.timings],
        publish=[stage_pb2.Publish(seq_id=p.seq_id, first_block=p.first_block, hashes=p.hashes)
                 for p in step.publish],
        evict=step.evict, block_size=step.block_size)


def chores_to_pb(msg: stage_pb2.StepRequest) -> stage_pb2.StepRequest | None:
    """`msg`'s releases, publications and evictions without its work (see Step.chores), or None;
    marked unanswered: the stages after the one that failed `msg` apply them and reply nothing."""
    if not (msg.release or msg.publish or msg.evict):
        return None
    return stage_pb2.StepRequest(plan_id=msg.plan_id, step_id=msg.step_id, input=_NO_INPUT, release=msg.release,
                                 publish=msg.publish, evict=msg.evict, block_size=msg.block_size, unanswered=True,
                                 leader_id=msg.leader_id)


def kept_seqs_to_pb(entries, kept) -> list[stage_pb2.SeqEntry]:
    """The entries a stage passes on after skipping carried rows (engine/kv_carry.py): each kept
    entry as it came, with its new start and row count."""
    out = []
    for k in kept:
        entry = stage_pb2.SeqEntry()
        entry.CopyFrom(entries[k.index])
        entry.start, entry.num_tokens = k.start, k.num_tokens
        out.append(entry)
    return out


def step_from_pb(msg: stage_pb2.StepRequest, limits: StepLimits = WIRE_LIMITS, samples: bool = True) -> Step:
    """The step `msg` carries, checked against the limits of the plan it names (see step_limits.py).
    `samples`: whether this stage samples (the last); the others pass the allowed-token masks on as
    they came (the request's own bytes) and never inflate them, so they leave them out of the Step
    (the last stage checks them: a malformed mask still fails the step there)."""
    if len(msg.seqs) > limits.max_seqs:
        raise PlanLimitExceeded(f"step carries {len(msg.seqs)} sequences; the plan's batch is {limits.max_seqs}")
    if len(msg.release) > WIRE_MAX_LIST or len(msg.evict) > WIRE_MAX_LIST:
        raise MalformedMessage(f"step releases {len(msg.release)} sequences and evicts {len(msg.evict)} blocks; "
                               f"at most {WIRE_MAX_LIST} each")
    if not 0 <= msg.block_size <= WIRE_MAX_BLOCK_SIZE or (
            msg.block_size and limits.prefix_block_size not in (None, msg.block_size)):
        raise MalformedMessage(f"block_size {msg.block_size} is not the plan's prefix-cache block size "
                               f"{limits.prefix_block_size}")
    seqs, seen, total = [], set(), 0
    mask_words_left = MAX_STEP_MASK_BYTES // 4
    for e in msg.seqs:
        if e.seq_id in seen:
            raise MalformedMessage(f"sequence {e.seq_id} appears twice in step {msg.step_id}")
        if not (0 <= e.start and 1 <= e.num_tokens):
            raise MalformedMessage(f"sequence {e.seq_id}: start {e.start} / num_tokens {e.num_tokens} out of range")
        if e.start + e.num_tokens > limits.max_context:
            raise PlanLimitExceeded(f"sequence {e.seq_id} reaches position {e.start + e.num_tokens}, beyond the "
                                    f"plan's context of {limits.max_context}")
        seen.add(e.seq_id)
        total += e.num_tokens
        if total > limits.max_step_tokens:
            raise PlanLimitExceeded(f"step carries more than {limits.max_step_tokens} tokens, the plan's step limit")
        if len(e.draft) > MAX_DRAFT_TOKENS or not scored_rows_fit(e.num_scored, len(e.draft), e.num_tokens):
            raise MalformedMessage(f"sequence {e.seq_id}: {e.num_scored} scored rows for {len(e.draft)} draft tokens "
                                   f"in {e.num_tokens} rows (at most {MAX_DRAFT_TOKENS} drafts; scored must be 0 or "
                                   f"drafts + 1)")
        sampling = sampling_from_pb(e.sampling) if e.num_scored else None
        if e.attach and (len(e.attach) * msg.block_size != e.start or len(e.attach) > limits.max_prefix_blocks):
            raise MalformedMessage(f"sequence {e.seq_id} attaches {len(e.attach)} blocks of {msg.block_size} "
                                   f"tokens but starts at {e.start} (the plan keeps {limits.max_prefix_blocks} "
                                   f"blocks)")
        if e.allowed and len(e.allowed) != e.num_scored:
            raise MalformedMessage(f"sequence {e.seq_id}: {len(e.allowed)} allowed-token masks for {e.num_scored} "
                                   f"scored rows")
        masks = []
        for data in e.allowed if samples else ():
            if mask_words_left <= 0:
                raise PlanLimitExceeded(f"step {msg.step_id}'s allowed-token masks exceed {MAX_STEP_MASK_BYTES} "
                                        f"bytes in all")
            masks.append(mask_from_bytes(data, min(MAX_MASK_WORDS, mask_words_left)))
            mask_words_left -= masks[-1].numel()
        seqs.append(SeqWork(SeqId(e.seq_id), e.start, e.num_tokens, e.num_scored, sampling, tuple(e.attach),
                            tuple(e.draft), _penalties_from_pb(e, limits), tuple(masks), _dists_from_pb(e)))
    x = codec.from_pb(msg.input) if msg.HasField("input") else None
    if x is None or x.dim() == 0 or x.shape[0] != total:
        raise MalformedMessage(f"step {msg.step_id} input has {None if x is None or x.dim() == 0 else x.shape[0]} "
                               f"rows for {total} tokens")
    publish = tuple(Publish(SeqId(p.seq_id), p.first_block, tuple(p.hashes)) for p in msg.publish)
    num_published = sum(len(p.hashes) for p in publish)
    if any(p.first_block < 0 for p in publish) or (publish and msg.block_size == 0) \
            or num_published > max(limits.max_prefix_blocks, 0):
        raise MalformedMessage(f"publish entries need a block_size, non-negative first_block and at most "
                               f"{limits.max_prefix_blocks} blocks in all (got {num_published})")
    return Step(msg.step_id, tuple(seqs), x, tuple(SeqId(s) for s in msg.release),
                tuple(timing_from_pb(t) for t in msg.timings), publish, tuple(msg.evict), msg.block_size)


def limits_to_pb(limits: StepLimits, request: stage_pb2.LoadRequest) -> None:
    """Write `limits` into a LoadRequest."""
    request.max_context = limits.max_context
    request.max_seqs = limits.max_seqs
    request.max_step_tokens = limits.max_step_tokens
    request.prefix_block_size = limits.prefix_block_size or 0
    request.max_prefix_blocks = limits.max_prefix_blocks


def limits_from_pb(request: stage_pb2.LoadRequest) -> StepLimits:
    """The plan's limits from a LoadRequest; the wire's own for one that sets none (an older leader)."""
    if not request.max_context:
        return WIRE_LIMITS
    try:
        return StepLimits(request.max_context, request.max_seqs, request.max_step_tokens,
                          request.prefix_block_size or None, request.max_prefix_blocks)
    except ValueError as e:
        raise BadRequest(f"the plan's step limits are invalid: {e}") from None


def _dists_from_pb(e: stage_pb2.SeqEntry) -> tuple[DraftDist, ...] | None:
    if not e.draft_dists:
        return None
    if len(e.draft_dists) != len(e.draft):
        raise MalformedMessage(f"sequence {e.seq_id}: {len(e.draft_dists)} draft distributions for "
                               f"{len(e.draft)} draft tokens")
    dists = []
    for token, d in zip(e.draft, e.draft_dists):
        if not 0 < len(d.ids) == len(d.probs) <= MAX_DRAFT_SUPPORT or len(set(d.ids)) != len(d.ids):
            raise MalformedMessage(f"sequence {e.seq_id}: a draft distribution needs 1 to {MAX_DRAFT_SUPPORT} "
                                   f"distinct ids, each with a probability")
        if any(not 0.0 <= p <= 1.0 for p in d.probs) or abs(sum(d.probs) - 1.0) > 1e-6 or token not in d.ids:
            raise MalformedMessage(f"sequence {e.seq_id}: a draft distribution must sum to 1 and contain "
                                   f"its draft token")
        dists.append(DraftDist(tuple(d.ids), tuple(d.probs)))
    return tuple(dists)


def timing_to_pb(t: StageTiming) -> stage_pb2.StageTiming:
    return stage_pb2.StageTiming(stage_index=t.stage_index, compute_s=t.compute_s,
                                 received_at=t.received_at, sent_at=t.sent_at)


def timing_from_pb(m: stage_pb2.StageTiming) -> StageTiming:
    return StageTiming(m.stage_index, m.compute_s, m.received_at, m.sent_at)


def tokens_to_pb(tokens: list[SampledToken]) -> list[stage_pb2.SampledToken]:
    out = []
    for t in tokens:
        msg = stage_pb2.SampledToken(seq_id=t.seq_id, token_id=t.token_id, position=t.position)
        if t.logprobs is not None:
            msg.logprob = t.logprobs.logprob
            msg.top.extend(stage_pb2.TokenLogprob(token_id=i, logprob=lp)
                           for i, lp in zip(t.logprobs.top_ids, t.logprobs.top_logprobs))
        out.append(msg)
    return out


def result_from_pb(msg: stage_pb2.StepReply) -> StepResult:
    tokens = []
    for t in msg.tokens:
        lp = None
        if t.HasField("logprob"):
            lp = TokenLogprobs(t.token_id, t.logprob, tuple(x.token_id for x in t.top),
                               tuple(x.logprob for x in t.top))
        tokens.append(SampledToken(SeqId(t.seq_id), t.position, t.token_id, lp))
    return StepResult(msg.step_id, tuple(tokens), tuple(timing_from_pb(t) for t in msg.timings),
                      msg.error_code or None, msg.error_message,
                      msg.failed_stage if msg.error_code else None)


def error_reply(step_id: int, code: str, message: str, stage_index: int,
                timings=()) -> stage_pb2.StepReply:
    return stage_pb2.StepReply(step_id=step_id, error_code=code, error_message=message,
                               failed_stage=stage_index, timings=list(timings))


def rank_role_from_pb(request: stage_pb2.LoadRequest) -> RankRole | None:
    """This node's rank of a tensor-parallel stage, or None for a stage of its own."""
    if not request.HasField("tp"):
        return None
    tp = request.tp
    if not 2 <= tp.size <= MAX_TP_SIZE or len(tp.group_id) > 128 or not tp.timeout_s >= 0:
        raise BadRequest(f"tensor-parallel group of {tp.size} (group id of {len(tp.group_id)} characters, "
                         f"timeout {tp.timeout_s}) is out of range: 2..{MAX_TP_SIZE} ranks")
    host, sep, port = tp.store_address.rpartition(":")
    if not (sep and host and port.isdigit()):
        raise BadRequest(f"tensor-parallel store address {tp.store_address!r} is not host:port")
    return RankRole(tp.rank, tp.size, tp.store_address, tp.group_id, tp.timeout_s or DEFAULT_TIMEOUT_S)


def rank_role_to_pb(role: RankRole) -> stage_pb2.TensorParallel:
    return stage_pb2.TensorParallel(rank=role.rank, size=role.size, store_address=role.store_address,
                                    group_id=role.group_id, timeout_s=role.timeout_s)


_MISSING_BYTES_KEY, _PART_KEY = "meshllm-missing-bytes", "meshllm-missing-part"


def shortfall_metadata(e: ShardUnavailable) -> tuple[tuple[str, str], ...]:
    """A node's refusal's figures as gRPC trailing metadata (read back by shortfall_from_metadata)."""
    return tuple((k, str(v)) for k, v in ((_MISSING_BYTES_KEY, e.missing_bytes), (_PART_KEY, e.part)) if v is not None)


def shortfall_from_metadata(metadata) -> tuple[int | None, str | None]:
    """(missing bytes, part) from a refusal's trailing metadata; None for what is absent or malformed
    (a peer's figures are checked like any other input)."""
    found = dict(metadata or ())
    text = found.get(_MISSING_BYTES_KEY, "")
    missing = int(text) if text.isdigit() and len(text) <= 20 else None
    part = found.get(_PART_KEY)
    return missing, part[:200] if isinstance(part, str) else None
