"""Turn a batch of logits into token ids, each row with its own sampling parameters.

The last pipeline stage calls `sample` on the logits of a micro-batch that mixes
sequences with different parameters. Determinism: every sequence owns a
`torch.Generator` seeded from its seed, and each sampled token draws exactly one
uniform number from it, so a sequence's tokens never depend on what else shares
the batch (or on whether a row was greedy, filtered, or alone).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from meshllm.engine.logit_processors import NO_INPUTS, RowInputs, process_logits
from meshllm.errors import BadRequest

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one sequence picks tokens and when it stops (OpenAI semantics).

    temperature 0 is greedy (argmax, ties to the lowest id). top_k None keeps every
    token; top_p 1.0 keeps the whole distribution, 0 the likeliest token only (OpenAI takes 0 as
    the smallest nucleus, and clients send it). seed None draws a fresh seed.
    logprobs None returns none; N returns the chosen token's logprob plus the N most
    likely alternatives, from the unmodified model distribution.

    Logit processing (logit_processors.py): logit_bias adds to token logits (OpenAI: -100
    bans, 100 forces); frequency_penalty and presence_penalty subtract count * f + p from
    tokens generated so far; repetition_penalty (vLLM's extension) divides positive and
    multiplies negative logits of tokens in the prompt or output. min_p drops tokens less
    likely than min_p times the likeliest one (after temperature).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False  # benchmarks generate exactly max_tokens
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct

    def __post_init__(self):
        if not 0.0 <= self.temperature <= 100.0:
            raise BadRequest(f"temperature must be in [0, 100], got {self.temperature}; use 0 for greedy")
        if not 0.0 <= self.top_p <= 1.0:
            raise BadRequest(f"top_p must be in [0, 1], got {self.top_p}; use 1 to disable nucleus sampling")
        if self.top_k is not None and self.top_k < 1:
            raise BadRequest(f"top_k must be at least 1, got {self.top_k}; leave it unset to keep every token")
        if self.max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise BadRequest(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0.0 <= self.min_p <= 1.0:
            raise BadRequest(f"min_p must be in [0, 1], got {self.min_p}; use 0 to disable it")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise BadRequest(f"{name} must be in [-2, 2], got {value}; use 0 to disable it")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise BadRequest(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                             f"{self.repetition_penalty}; use 1 to disable it")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise BadRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise BadRequest("logit_bias names a token twice")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise BadRequest(f"logit_bias token id {token_id} is negative")
            if not -100.0 <= bias <= 100.0:
                raise BadRequest(f"logit_bias of token {token_id} must be in [-100, 100], got {bias}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether logit_bias or a penalty changes its logits before a token is picked."""
        return bool(self.logit_bias) or self.penalises

    @property
    def penalises(self) -> bool:
        """Whether the sequence's history shapes its logits (the leader then ships its counts)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The chosen token's log-probability and the `len(top_ids)` most likely tokens'."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: Tensor  # [n] int64
    logprobs: tuple[TokenLogprobs | None, ...]  # per row; None where the row did not ask
    processed: Tensor  # the logits the choice was made from: penalties, bias and grammar masks applied


def draw_seed(seed: int, position: int) -> int:
    """Seed of the draw for the token at `position`: a pure function, so a replayed
    step (failover), another batch composition or a verification step draws exactly
    the same number as plain decoding did."""
    return (seed * _SEED_MIX + position) & _SEED_MASK


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator for the one draw of the token at `position` of a sequence seeded `seed`."""
    g = torch.Generator()
    g.manual_seed(draw_seed(seed, position))
    return g


def make_generator(seed: int | None) -> torch.Generator:
    """The generator a sequence owns for its whole life; a fresh random seed when None."""
    g = torch.Generator()
    g.manual_seed(secrets.randbits(63) if seed is None else seed)
    return g


def argmax_ids(logits: Tensor) -> Tensor:
    """Per row, the first id of the highest logit (int64). numpy's on CPU fp32: ~12x faster than
    torch's on one thread (16 SmolLM2 rows 0.05 ms against 0.66; one row 4 us against 43). Both
    take the first of tied maxima, and a NaN as the maximum."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def sample(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           rows: Sequence[RowInputs] | None = None) -> SampleOutput:
    """Pick one token per row of `logits` [n, vocab] (fp32).

    `generators[i]` belongs to row i's sequence and is advanced by one draw when the
    row samples (greedy rows may pass None and draw nothing). `rows[i]` carries row i's
    penalty counts and allowed tokens (None: none for any row).
    """
    n = logits.shape[0]
    assert len(params) == n == len(generators), (logits.shape, len(params), len(generators))
    processed = process_logits(logits, params, rows if rows is not None else [NO_INPUTS] * n)
    token_ids = argmax_ids(processed)  # greedy rows; ties go to the lowest id
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    for i in sampled:
        token_ids[i] = _draw(processed[i], params[i], generators[i])
    logprobs = tuple(None if p.logprobs is None else _logprobs(logits[i], int(token_ids[i]), p.logprobs)
                     for i, p in enumerate(params))
    return SampleOutput(token_ids, logprobs, processed)


def _draw(row: Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    # Inverse-CDF sampling from one uniform number: the draw count per token is fixed,
    # so the generator's state depends only on how many tokens the sequence sampled.
    assert generator is not None, "a sampled row needs its sequence's generator"
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    probs, ids = target_distribution(row, p)
    index = inverse_cdf(probs, u)
    return index if ids is None else int(ids[index])


def target_distribution(row: Tensor, p: SamplingParams) -> tuple[Tensor, Tensor | None]:
    """What a sampled row draws from: probabilities over the whole vocabulary (ids None), or
    over `ids` after top-k / top-p (zeros past the nucleus). Speculative sampling compares
    draft distributions against exactly this."""
    scaled = row.float() / p.temperature
    if p.min_p > 0.0:
        # min_p: keep tokens at least min_p times as likely as the likeliest (same as a logit gap).
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(p.min_p), float("-inf"))
    if p.top_k is None and p.top_p >= 1.0:
        return torch.softmax(scaled, dim=-1), None
    k = row.shape[-1] if p.top_k is None else min(p.top_k, row.shape[-1])
    values, ids = torch.topk(scaled, k, sorted=True)
    probs = torch.softmax(values, dim=-1)
    if p.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p: always the first token (top_p 0 too).
        before = torch.cumsum(probs, dim=-1) - probs
        keep = before < p.top_p
        keep[..., 0] = True
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs, ids


def inverse_cdf(probs: Tensor, u: float) -> int:
    """The index a uniform number u in [0, 1) picks from unnormalised probabilities `probs`."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    index = int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True).clamp_(max=cdf.numel() - 1))
    while float(probs[index]) == 0.0 and index > 0:  # rounding at the top end of the cdf
        index -= 1
    return index


def token_logprobs(row: Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """`token_id`'s logprob and the `num_top` likeliest tokens', from the unmodified row."""
    return _logprobs(row, token_id, num_top)


def _logprobs(row: Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    logp = torch.log_softmax(row.float(), dim=-1)
    top = torch.topk(logp, num_top) if num_top else None
    return TokenLogprobs(
        token_id=token_id,
        logprob=float(logp[token_id]),
        top_ids=tuple(top.indices.tolist()) if top is not None else (),
        top_logprobs=tuple(top.values.tolist()) if top is not None else (),
    )
