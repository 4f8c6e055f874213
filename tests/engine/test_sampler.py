"""The batched sampler: greedy, temperature, top-k, top-p, seeds, logprobs, per-row independence."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from meshllm.engine.sampler import MAX_LOGPROBS, SamplingParams, make_generator, sample
from meshllm.errors import BadRequest

GREEDY = SamplingParams(temperature=0.0)


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()[None]


def _draws(logits: torch.Tensor, params: SamplingParams, num: int) -> list[int]:
    return [int(sample(logits, [params], [make_generator(seed)]).token_ids[0]) for seed in range(num)]


def test_greedy_is_argmax_with_ties_to_the_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -3.0]])
    out = sample(logits, [GREEDY] * 3, [None] * 3)
    assert out.token_ids.tolist() == [1, 0, 2]
    assert out.logprobs == (None, None, None)


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    assert set(_draws(logits, SamplingParams(temperature=5.0, top_k=1), 30)) == {best}


def test_top_k_samples_only_among_the_k_most_likely():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    top5 = set(logits[0].topk(5).indices.tolist())
    drawn = set(_draws(logits, SamplingParams(temperature=2.0, top_k=5), 300))
    assert drawn <= top5
    assert len(drawn) >= 4  # a high temperature spreads the draws over the five


# top_p 0: the likeliest token only (OpenAI takes 0 as the smallest nucleus; it used to keep none).
@pytest.mark.parametrize(("top_p", "allowed"), [(0.0, {0}), (0.5, {0}), (0.6, {0, 1}), (0.85, {0, 1, 2}),
                                                (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p, allowed):
    logits = _logits_of([0.5, 0.3, 0.15, 0.05])
    assert set(_draws(logits, SamplingParams(top_p=top_p), 400)) == allowed


def test_sampled_frequencies_follow_the_softmax():
    probs = [0.5, 0.3, 0.15, 0.05]
    draws = _draws(_logits_of(probs), SamplingParams(), 4000)
    for token, p in enumerate(probs):
        freq = draws.count(token) / len(draws)
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / len(draws)), (token, freq, p)


def test_temperature_sharpens_and_flattens():
    logits = _logits_of([0.6, 0.3, 0.1])
    cold = _draws(logits, SamplingParams(temperature=0.2), 500)
    hot = _draws(logits, SamplingParams(temperature=5.0), 500)
    assert cold.count(0) > 480  # 0.6^5 / (0.6^5 + 0.3^5 + 0.1^5) ~ 0.97
    assert hot.count(2) > 100  # nearly uniform


def test_same_seed_same_token_and_one_draw_per_token():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
    g1, g2 = make_generator(7), make_generator(7)
    assert [int(sample(logits, [params], [g1]).token_ids[0]) for _ in range(20)] == \
        [int(sample(logits, [params], [g2]).token_ids[0]) for _ in range(20)]
    # The generator moved by exactly one uniform per token, whatever the filters.
    g3, reference = make_generator(7), make_generator(7)
    sample(logits, [params], [g3])
    torch.rand((), generator=reference, dtype=torch.float64)
    assert torch.equal(g3.get_state(), reference.get_state())


def test_a_rows_token_does_not_depend_on_the_rest_of_the_batch():
    vocab = 200
    rows = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.7, seed=11), GREEDY, SamplingParams(temperature=1.3, top_k=20, seed=5),
              SamplingParams(top_p=0.8, seed=9)]
    batched = sample(rows, params, [None if p.greedy else make_generator(p.seed) for p in params]).token_ids
    for i, p in enumerate(params):
        solo = sample(rows[i:i + 1], [p], [None if p.greedy else make_generator(p.seed)]).token_ids
        assert int(solo[0]) == int(batched[i])


def test_logprobs_are_the_model_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=3)], [None])
    lp = out.logprobs[0]
    expected = torch.log_softmax(logits[0], dim=-1)
    assert lp.token_id == 4
    assert lp.logprob == pytest.approx(float(expected[4]))
    assert lp.top_ids == (4, 0, 1)
    assert lp.top_logprobs == pytest.approx([float(expected[i]) for i in (4, 0, 1)])
    # Sampled rows report the logprob of the token they drew, from the untempered distribution.
    drawn = sample(logits, [SamplingParams(temperature=3.0, logprobs=0)], [make_generator(1)])
    token = int(drawn.token_ids[0])
    assert drawn.logprobs[0].token_id == token and drawn.logprobs[0].top_ids == ()
    assert drawn.logprobs[0].logprob == pytest.approx(float(expected[token]))


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=-0.1), dict(top_p=1.5), dict(top_k=0),
                                 dict(max_tokens=0), dict(stop=("",)), dict(stop=["x"]),
                                 dict(logprobs=MAX_LOGPROBS + 1), dict(logprobs=-1)])
def test_bad_parameters_are_rejected_with_the_value(bad):
    with pytest.raises(BadRequest) as e:
        SamplingParams(**bad)
    assert str(next(iter(bad.values())))[:3] in str(e.value)


@settings(max_examples=60, deadline=None)
@given(probs=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=12).filter(lambda p: sum(p) > 1e-3),
       seed=st.integers(0, 2**32), top_k=st.one_of(st.none(), st.integers(1, 12)),
       top_p=st.floats(0.05, 1.0), temperature=st.floats(0.05, 4.0))
def test_never_samples_a_token_of_probability_zero(probs, seed, top_k, top_p, temperature):
    given = torch.tensor(probs)  # float32: what the sampler sees (0.9999999999999999 and 1.0 tie there)
    logits = given.log()[None]  # zero probability -> -inf logit
    token = int(sample(logits, [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)],
                       [make_generator(seed)]).token_ids[0])
    seen = given.tolist()
    assert seen[token] > 0.0
    if top_k is not None:
        assert sum(p > seen[token] for p in seen) < top_k
