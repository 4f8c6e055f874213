"""Logit processing at the sampling stage: logit_bias, frequency/presence/repetition penalties,
grammar bitmasks and min_p change the distribution exactly as specified, batched per row."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from meshllm.engine.logit_processors import (NO_INPUTS, PenaltyCounts, RowInputs, process_logits,
                                             unpack_bitmask)
from meshllm.engine.sampler import SamplingParams, make_generator, sample
from meshllm.errors import BadRequest

GREEDY = SamplingParams(temperature=0.0)


def _bitmask(allowed: list[int], vocab: int) -> torch.Tensor:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.from_numpy(np.array(words, dtype=np.uint32).view(np.int32))


def _frequencies(logits: torch.Tensor, params: SamplingParams, rows: RowInputs, num: int) -> torch.Tensor:
    counts = torch.zeros(logits.shape[1])
    for seed in range(num):
        counts[int(sample(logits, [params], [make_generator(seed)], [rows]).token_ids[0])] += 1
    return counts / num


def _assert_distributed_as(freq: torch.Tensor, probs: torch.Tensor, num: int) -> None:
    # each frequency within 4.5 standard errors of its probability (binomial), so a wrong formula fails
    bound = 4.5 * torch.sqrt(probs * (1 - probs) / num) + 1e-9
    assert bool(((freq - probs).abs() <= bound).all()), (freq, probs)


def test_logit_bias_bans_and_forces_tokens():
    logits = torch.tensor([[3.0, 1.0, 0.5, -1.0]])
    banned = SamplingParams(temperature=0.0, logit_bias=((0, -100.0),))
    assert int(sample(logits, [banned], [None], [NO_INPUTS]).token_ids[0]) == 1
    forced = SamplingParams(temperature=1.0, logit_bias=((3, 100.0),))
    assert _frequencies(logits, forced, NO_INPUTS, 50)[3] == 1.0
    # a moderate bias shifts the distribution by exactly exp(bias) in odds
    shifted = SamplingParams(temperature=1.0, logit_bias=((2, 1.5), (0, -0.5)))
    expected = torch.softmax(logits[0] + torch.tensor([-0.5, 0.0, 1.5, 0.0]), -1)
    _assert_distributed_as(_frequencies(logits, shifted, NO_INPUTS, 3000), expected, 3000)


def test_frequency_and_presence_penalties_follow_openai_formula():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    counts = PenaltyCounts.of(params, prompt_ids=[4, 4], output_counts=Counter({0: 3, 3: 1}))
    assert dict(zip(counts.ids, counts.counts)) == {0: 3, 3: 1}  # the prompt only counts for repetition
    out = process_logits(logits, [params], [RowInputs(counts)])
    assert out[0].tolist() == pytest.approx([2.0 - 3 * 0.5 - 0.25, 1.0, 0.0, -1.0 - 0.5 - 0.25, 0.5])
    assert logits[0, 0] == 2.0  # the model's row is left alone (logprobs report it)
    _assert_distributed_as(_frequencies(logits, params, RowInputs(counts), 3000), torch.softmax(out[0], -1), 3000)
    # negative penalties encourage repetition
    encourage = SamplingParams(frequency_penalty=-2.0)
    out = process_logits(logits, [encourage], [RowInputs(PenaltyCounts.of(encourage, [], Counter({2: 2})))])
    assert out[0, 2] == pytest.approx(4.0)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    counts = PenaltyCounts.of(params, prompt_ids=[1, 3], output_counts=Counter({3: 2}))
    assert dict(zip(counts.ids, counts.counts)) == {3: 2, 1: 0}
    out = process_logits(logits, [params], [RowInputs(counts)])
    assert out[0].tolist() == pytest.approx([2.0, -2.0, 0.5, 1.5])
    assert int(sample(logits, [params], [None], [RowInputs(counts)]).token_ids[0]) == 0  # 3 lost its lead


def test_masks_come_out_the_same_from_numpy_and_from_torch(monkeypatch):
    """CPU tensors take numpy's path (faster); devices take torch's: both must agree bit for bit,
    with masks narrower and wider than the vocabulary, and rows without a mask left alone."""
    from meshllm.engine import logit_processors

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 70, generator=gen)
    rows = [RowInputs(allowed=_bitmask([0, 5, 33, 69], 70)), RowInputs(),
            RowInputs(allowed=_bitmask([1, 40], 64)),  # two words: tokens 64-69 not allowed
            RowInputs(allowed=torch.tensor([-1, -1, -1, 7], dtype=torch.int32))]  # wider than 70 tokens
    params = [GREEDY] * 4
    fast = process_logits(logits, params, rows)
    words = torch.stack([_bitmask([2, 66], 70), _bitmask([0, 31, 32, 69], 70)])
    assert torch.equal(torch.from_numpy(logit_processors._unpacked(words.numpy(), 70)).bool(),
                       unpack_bitmask(words, 70))
    monkeypatch.setattr(logit_processors, "_numpy_path", lambda t: False)
    assert torch.equal(process_logits(logits, params, rows), fast)
    assert torch.equal(fast[1], logits[1]) and fast[2, 64:].eq(float("-inf")).all()


def test_grammar_bitmask_allows_only_its_tokens_and_beats_bias():
    vocab = 70  # three words, the last one partly past the vocabulary
    allowed = [0, 31, 32, 63, 64, 69]
    mask = _bitmask(allowed, vocab)
    assert unpack_bitmask(mask[None], vocab)[0].nonzero().flatten().tolist() == allowed
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, 5] = 50.0  # the model's favourite is not allowed
    params = SamplingParams(temperature=1.5, logit_bias=((7, 100.0),))
    rows = RowInputs(allowed=mask)
    freq = _frequencies(logits, params, rows, 400)
    assert set(freq.nonzero().flatten().tolist()) <= set(allowed)
    expected = torch.full((vocab,), float("-inf"))
    expected[allowed] = logits[0, allowed] / 1.5
    _assert_distributed_as(freq, torch.softmax(expected, -1), 400)
    best_allowed = allowed[int(logits[0, allowed].argmax())]
    assert int(sample(logits, [GREEDY], [None], [rows]).token_ids[0]) == best_allowed


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    logits = probs.log()[None]
    params = SamplingParams(temperature=1.0, min_p=0.2)  # threshold 0.1: token 3 is dropped
    freq = _frequencies(logits, params, NO_INPUTS, 3000)
    assert freq[3] == 0
    _assert_distributed_as(freq, torch.tensor([0.5, 0.3, 0.12, 0.0]) / 0.92, 3000)


def test_batched_processing_equals_row_by_row():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 100, generator=gen)
    params = [SamplingParams(frequency_penalty=1.0, presence_penalty=-0.5),
              SamplingParams(logit_bias=((9, 5.0), (10, -5.0))),
              SamplingParams(),
              SamplingParams(repetition_penalty=1.3, logit_bias=((1, 2.0),))]
    rows = [RowInputs(PenaltyCounts((1, 2, 3), (1, 4, 2))), RowInputs(allowed=_bitmask(list(range(0, 100, 3)), 100)),
            NO_INPUTS, RowInputs(PenaltyCounts((1, 50), (0, 2)))]
    batched = process_logits(logits, params, rows)
    for i in range(4):
        assert torch.equal(batched[i], process_logits(logits[i:i + 1], [params[i]], [rows[i]])[0])
    assert torch.equal(batched[2], logits[2])
    assert process_logits(logits, [SamplingParams()] * 4, [NO_INPUTS] * 4) is logits


def test_logprobs_report_the_models_distribution_not_the_processed_one():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, logprobs=1, logit_bias=((2, 10.0),))
    out = sample(logits, [params], [None], [NO_INPUTS])
    assert int(out.token_ids[0]) == 2
    assert out.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))


def test_extended_counts_add_draft_tokens():
    counts = PenaltyCounts((5, 6), (1, 0))
    extended = counts.extended([6, 7, 7])
    assert dict(zip(extended.ids, extended.counts)) == {5: 1, 6: 1, 7: 2}
    assert counts.extended([]) is counts


@pytest.mark.parametrize("field, value, message", [
    ("frequency_penalty", 2.5, r"frequency_penalty must be in \[-2, 2\]"),
    ("presence_penalty", -3.0, r"presence_penalty must be in \[-2, 2\]"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be in \(0, 10\]"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
    ("logit_bias", ((3, 101.0),), r"logit_bias of token 3 must be in \[-100, 100\]"),
    ("logit_bias", ((3, 1.0), (3, 2.0)), "names a token twice"),
    ("logit_bias", ((-1, 1.0),), "negative"),
])
def test_out_of_range_values_are_refused_with_the_range(field, value, message):
    with pytest.raises(BadRequest, match=message):
        SamplingParams(**{field: value})


def test_nothing_to_process_costs_nothing():
    assert not SamplingParams().penalises
    assert PenaltyCounts.of(SamplingParams(), [1, 2], Counter({3: 1})) == PenaltyCounts()
    assert math.isinf(process_logits(torch.zeros(1, 4), [SamplingParams()], [RowInputs(
        allowed=_bitmask([1], 4))])[0, 0])
