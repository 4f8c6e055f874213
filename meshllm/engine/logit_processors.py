"""What shapes a logit row before a token is picked: the grammar's allowed tokens, logit_bias,
and the repetition, frequency and presence penalties (OpenAI's and vLLM's semantics).

The last stage applies them to the rows it scores, batched over every row that needs
them, in this order: grammar mask, logit_bias, repetition penalty, frequency and
presence penalties. Temperature, min_p, top_k and top_p then act in the sampler.

Penalties look at a sequence's history, which only the leader has in full (the last
stage never sees token ids). The leader ships, per penalised sequence and step, the
distinct tokens the penalties apply to with how often each was generated (`PenaltyCounts`,
a few bytes per distinct token): stateless at the stage, so a replayed step, a rolled
back draft or a freshly failed-over last stage computes exactly the same row.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from meshllm.errors import MalformedMessage

if TYPE_CHECKING:  # sampler.py imports this module
    from meshllm.engine.sampler import SamplingParams


@dataclass(frozen=True, slots=True)
class PenaltyCounts:
    """Distinct token ids a sequence's penalties apply to, and how often each was generated
    (0: it is only in the prompt, which only repetition_penalty looks at)."""

    ids: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()

    def __post_init__(self):
        if len(self.ids) != len(self.counts):
            raise ValueError(f"{len(self.ids)} penalty ids but {len(self.counts)} counts")

    @classmethod
    def of(cls, params: SamplingParams, prompt_ids: Iterable[int], output_counts: Counter) -> "PenaltyCounts":
        """What the leader ships for a sequence (empty when its params penalise nothing)."""
        if not params.penalises:
            return cls()
        counts = dict(output_counts)
        if params.repetition_penalty != 1.0:
            for token_id in prompt_ids:
                counts.setdefault(token_id, 0)
        return cls(tuple(counts), tuple(counts.values()))

    def extended(self, draft: Sequence[int]) -> "PenaltyCounts":
        """The counts once `draft` tokens are generated too (a verified draft's later rows)."""
        if not draft:
            return self
        counts = dict(zip(self.ids, self.counts))
        for token_id in draft:
            counts[token_id] = counts.get(token_id, 0) + 1
        return PenaltyCounts(tuple(counts), tuple(counts.values()))


@dataclass(frozen=True, slots=True)
class RowInputs:
    """Per scored row, besides its SamplingParams: penalty counts and the allowed-token bitmask
    (int32 [ceil(vocab / 32)], bit i of word j allows token 32 j + i; None: no grammar)."""

    penalties: PenaltyCounts = PenaltyCounts()
    allowed: Tensor | None = None


NO_INPUTS = RowInputs()


def needs_processing(params: Sequence[SamplingParams], rows: Sequence[RowInputs]) -> bool:
    return any(r.allowed is not None for r in rows) or any(p.adjusts_logits for p in params)


def process_logits(logits: Tensor, params: Sequence[SamplingParams], rows: Sequence[RowInputs]) -> Tensor:
    """A processed copy of `logits` [n, vocab] (fp32); `logits` itself is left as the model's
    distribution (logprobs report that one). Returns `logits` unchanged when nothing applies."""
    assert logits.shape[0] == len(params) == len(rows), (logits.shape, len(params), len(rows))
    if not needs_processing(params, rows):
        return logits
    out = logits.float().clone()
    _apply_masks(out, rows)
    _apply_bias(out, params)
    _apply_penalties(out, params, rows)
    return out


def unpack_bitmask(words: Tensor, vocab_size: int) -> Tensor:
    """bool [n, vocab_size] from int32 bitmask words [n, w]. The model's vocabulary may be wider
    than the tokenizer's the mask was made for: tokens past the mask are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).reshape(words.shape[0], -1).bool()  # [n, 32 w]
    if bits.shape[1] < vocab_size:
        return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)
    return bits[:, :vocab_size]


def _numpy_path(t: Tensor) -> bool:
    # On the CPU numpy does the masks' work several times faster than torch's ops on one thread
    # (unpack_bitmask is the devices' way):
    # 16 SmolLM2 rows (49152 tokens) unpacked, checked and applied in ~0.6 ms against ~2 ms, in a
    # ~40 ms decode step. (Bit i of a little-endian int32 word is bit i % 8 of its byte i // 8.)
    return t.device.type == "cpu" and sys.byteorder == "little"


def _unpacked(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """uint8 0/1 [n, vocab_size] from int32 words [n, w]; tokens past the words are not allowed."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, bitorder="little")
    if bits.shape[1] < vocab_size:
        return np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return bits[:, :vocab_size]


def _apply_masks(out: Tensor, rows: Sequence[RowInputs]) -> None:
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not masked:
        return
    width = max(rows[i].allowed.numel() for i in masked)
    words = torch.stack([torch.nn.functional.pad(rows[i].allowed, (0, width - rows[i].allowed.numel()))
                         for i in masked])
    if _numpy_path(out):
        bits = _unpacked(words.numpy(), out.shape[1])
        if not bits.any(axis=1).all():
            raise MalformedMessage("an allowed-token mask allows no token of this model's vocabulary")
        rows_out = out.numpy()
        for row, i in enumerate(masked):
            np.copyto(rows_out[i], -np.inf, where=bits[row] == 0)
        return
    allowed = unpack_bitmask(words.to(out.device), out.shape[1])
    if not bool(allowed.any(dim=1).all()):
        raise MalformedMessage("an allowed-token mask allows no token of this model's vocabulary")
    for row, i in enumerate(masked):  # in place: indexing `out` by rows would copy them out and back
        out[i].masked_fill_(~allowed[row], float("-inf"))


def _apply_bias(out: Tensor, params: Sequence[SamplingParams]) -> None:
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            rows.append(i)
            ids.append(token_id)
            values.append(bias)
    if rows:
        _check_ids(ids, out.shape[1], "logit_bias")
        out.index_put_((torch.tensor(rows), torch.tensor(ids)), torch.tensor(values, dtype=out.dtype),
                       accumulate=True)


def _check_ids(ids: list[int], vocab_size: int, what: str) -> None:
    # ids come from a peer (or a client through the leader): never index past the logits
    if max(ids) >= vocab_size:
        raise MalformedMessage(f"{what} names token {max(ids)}, beyond this model's {vocab_size} tokens")


def _apply_penalties(out: Tensor, params: Sequence[SamplingParams], rows: Sequence[RowInputs]) -> None:
    # One gather/scatter over every (row, penalised token) pair of the batch.
    row_index, ids, counts, repetition, frequency, presence = [], [], [], [], [], []
    for i, (p, r) in enumerate(zip(params, rows)):
        if not p.penalises or not r.penalties.ids:
            continue
        n = len(r.penalties.ids)
        row_index += [i] * n
        ids += r.penalties.ids
        counts += r.penalties.counts
        repetition += [p.repetition_penalty] * n
        frequency += [p.frequency_penalty] * n
        presence += [p.presence_penalty] * n
    if not row_index:
        return
    _check_ids(ids, out.shape[1], "a penalty count")
    index = (torch.tensor(row_index), torch.tensor(ids))
    values = out[index]
    count = torch.tensor(counts, dtype=out.dtype)
    rep = torch.tensor(repetition, dtype=out.dtype)
    # repetition_penalty (CTRL, as transformers and vLLM): shrink a seen token's logit towards -inf
    values = torch.where(values > 0, values / rep, values * rep)
    values = values - torch.tensor(frequency, dtype=out.dtype) * count
    values = values - torch.tensor(presence, dtype=out.dtype) * (count > 0).to(out.dtype)
    out[index] = values
