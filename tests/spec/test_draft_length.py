"""Adaptive draft length: what is sent of a self-sized (n-gram) offer follows acceptance per
offered length and the measured cost of extra rows; no model, microseconds."""

from __future__ import annotations

import pytest

from meshllm.spec.draft_length import (DraftLength, DraftLengthConfig, OfferedLength, StepCosts, best_length,
                                       pipelined_length, probe_interval, wait_pays)

CONFIG = DraftLengthConfig(k_max=8, k_start=4, probe_every=8)


def costs(per_row: float) -> StepCosts:
    """Step seconds growing by `per_row` of a one-row step per extra row (1 to 9 rows measured)."""
    c = StepCosts()
    for rows in range(1, 10):
        c.observe(rows, 1.0 + per_row * (rows - 1))
    return c


# fp32 SmolLM2-135M on this machine, one thread: ms per step by rows (a second row nearly doubles it).
FP32_MS = {1: 85.6, 2: 153.4, 3: 174.8, 4: 144.4, 5: 158.0, 6: 144.9, 8: 161.2, 9: 172.0}


def test_long_offers_that_copy_are_sent_whole_while_short_chance_matches_are_dropped():
    lengths, rows_cost = OfferedLength(CONFIG), StepCosts()
    for rows, ms in FP32_MS.items():
        rows_cost.observe(rows, ms / 1000)
    for _ in range(20):
        lengths.update(8, 8, 8)  # long matches: copied passages, every token accepted
        lengths.update(1, 1, 0)  # one-token matches: chance, rejected
    assert lengths.send_length(8, rows_cost, 1) == 8
    # Only the probes go out, and rarely: a second fp32 row costs 0.79 of a step here, so a probe
    # every 8 steps would cost ~10% of them; scaled to ~1%, one every ~79 steps.
    interval = probe_interval(CONFIG, rows_cost, 1)
    assert 70 <= interval <= 90
    sent = [lengths.send_length(1, rows_cost, 1) for _ in range(2 * interval)]
    assert sent.count(1) == 2 and sent.count(0) == 2 * interval - 2


def test_offers_of_every_length_share_one_probe_budget():
    """Free text offers chance matches of many lengths; all of them together probe as often as
    one length would (every probe_interval offers not sent), not once per length each."""
    lengths, rows_cost = OfferedLength(CONFIG), StepCosts()
    for rows, ms in FP32_MS.items():
        rows_cost.observe(rows, ms / 1000)
    for offered in (1, 2, 3, 5, 9):
        for _ in range(20):
            lengths.update(offered, offered, 0)  # never accepted, at any length
    interval = probe_interval(CONFIG, rows_cost, 1)
    sent = [lengths.send_length((1, 2, 3, 5, 9)[i % 5], rows_cost, 1) for i in range(2 * interval)]
    assert sum(1 for m in sent if m) == 2 and all(m <= 1 for m in sent)


def test_probes_of_a_batch_together_cost_about_one_percent_of_its_steps():
    """Every sequence of a step probes on its own: at batch 8 on SmolLM2 Q4_1 (measured: 67.5 ms for
    8 rows, 86.9 ms for 9) a probe row costs 0.29 of a step, so 8 sequences probing every 29 steps
    spent ~8% of the steps on probes (free text 0.92-0.95x plain); the interval grows with the batch."""
    batch = _costs({8: 0.0675, 9: 0.0869})
    alone = probe_interval(CONFIG, batch, 1)  # nothing measured around 1 row: the prior row cost
    assert alone == CONFIG.probe_every
    interval = probe_interval(CONFIG, batch, 8)
    assert 8 * (batch.ratio(8, 1) - 1) / interval <= 0.011  # probe rows' share of the step time
    assert interval > 8 * probe_interval(CONFIG, _costs({1: 0.0675, 2: 0.0869}), 1) * 0.9


def test_one_alpha_per_sequence_would_cap_the_copied_passages():
    # The reason for OfferedLength: the same history through DraftLength's single alpha.
    # Free text with a copied passage now and then: four chance one-token matches per copy.
    single, cheap = DraftLength(CONFIG), costs(0.03)
    offered = OfferedLength(CONFIG)
    for _ in range(20):
        single.update(8, 8, cheap, 9)
        offered.update(8, 8, 8)
        for _ in range(4):
            single.update(1, 0, cheap, 2)
            offered.update(1, 1, 0)
    assert single.k < 8 <= offered.send_length(8, cheap, 1)


def test_cheap_rows_keep_drafting_at_modest_acceptance():
    lengths = OfferedLength(CONFIG)
    for _ in range(20):
        lengths.update(2, 2, 1)  # half of two-token offers accepted
    assert lengths.send_length(2, costs(0.03), 1) == 2
    assert lengths.send_length(2, costs(2.0), 1) == 0  # the same acceptance cannot pay for dear rows


def _costs(seconds_by_count: dict[int, float], widest_slope: bool = False) -> StepCosts:
    costs = StepCosts(widest_slope)
    for count, seconds in seconds_by_count.items():
        costs.observe(count, seconds)
    return costs


def test_call_time_is_extrapolated_along_the_measured_line():
    draft = _costs({2: 0.027, 5: 0.063})  # 3 ms per call, 12 ms per token
    assert draft.seconds(3) == pytest.approx(0.039)
    assert draft.seconds(8) == pytest.approx(0.099)
    assert draft.seconds(1) == pytest.approx(0.015)
    assert _costs({4: 0.040}).seconds(2) == pytest.approx(0.020)  # one size seen: proportional


def test_a_proposer_slower_than_the_verifier_gets_the_block_it_can_keep_ahead_of():
    """SmolLM2 measured here: an fp32 verifier (24 ms a step, 44/50/54/58 ms for 2-5 rows) and a
    Q4_1 drafter on another core (3 ms a call + 12 ms a token), acceptance 0.95: blocks of 3-4
    drafts keep both busy (E(k) / max(T(k+1), D(k+1)) is best there), 1.6x plain decoding."""
    verifier = _costs({1: 0.024, 2: 0.044, 3: 0.050, 4: 0.054, 5: 0.058, 6: 0.062})
    drafter = _costs({2: 0.027, 5: 0.063})
    assert pipelined_length(0.95, 8, verifier, 1, drafter) in (3, 4)
    # The same drafter for a verifier as fast as itself (bf16, 13 ms): it cannot keep ahead.
    bf16 = _costs({1: 0.013, 2: 0.014, 3: 0.017, 4: 0.022, 5: 0.029})
    assert pipelined_length(0.95, 8, bf16, 1, drafter) == 0


def test_long_blocks_pay_for_what_a_rejection_throws_away():
    """Measured on the two-machine bench: a bf16 verifier whose extra rows are nearly free (18 ms a
    step, 20-24 ms for 2-9 rows) and a Q4_1 draft node whose 5- and 6-token calls happened to be
    measured alike. Extrapolating 9-token calls along those two made them look as cheap as 6, and
    with nothing charged for the block a rejection throws away, 8-token blocks won; they spent
    110-120 ms after each rejection getting back on track, against ~50 ms with short blocks."""
    verifier = _costs({1: 0.018, 2: 0.024, 3: 0.020, 4: 0.021, 5: 0.020, 9: 0.023})
    drafter = _costs({2: 0.017, 3: 0.029, 4: 0.038, 5: 0.044, 6: 0.044}, widest_slope=True)
    assert drafter.seconds(9) == pytest.approx(0.044 + 3 * (0.044 - 0.017) / 4)  # the widest slope
    assert pipelined_length(0.9, 8, verifier, 1, drafter) in (1, 2, 3)
    assert pipelined_length(0.95, 8, verifier, 1, drafter) < 8


def test_drafting_goes_on_after_rejections_while_blocks_beat_the_plain_steps_they_cost():
    """The two-machine bench, traced: a bf16 verifier on one core (10.5 ms a step, 18-20 ms for 2-3
    rows, with the leader's own work beside it) and a Q4_1 draft node (17-20 ms for a 2-3 token
    call). After two rejections in a row (acceptance ~0.75) every block looked slower than plain
    decoding while a rejection's recovery counted as time that commits nothing, and drafting
    stopped for ~30 plain steps. The plain steps decoded during a recovery count now: blocks of 2
    go on down to ~0.7, and drafts that mostly fail still stop."""
    verifier = _costs({1: 0.0105, 2: 0.0204, 3: 0.0185, 4: 0.021, 5: 0.0163, 6: 0.018})
    drafter = _costs({2: 0.017, 3: 0.020, 4: 0.025, 6: 0.040}, widest_slope=True)
    assert [pipelined_length(a, 8, verifier, 1, drafter) for a in (0.95, 0.85, 0.75, 0.7)] == [2, 2, 2, 2]
    assert pipelined_length(0.6, 8, verifier, 1, drafter) == 0


def test_waiting_for_a_draft_pays_only_when_it_commits_more_per_second():
    verifier = _costs({1: 0.024, 4: 0.054})
    assert wait_pays(0.95, 3, verifier, 1, wait_s=0.010)  # 3.7 tokens in 64 ms beats 2.7 plain steps
    assert not wait_pays(0.95, 3, verifier, 1, wait_s=0.050)  # 3.7 in 104 ms loses to 4.3 plain steps
    assert not wait_pays(0.3, 3, verifier, 1, wait_s=0.001)  # drafts that mostly fail never pay


def test_a_draft_in_a_full_batch_must_pay_for_its_rows_against_the_whole_step():
    """bf16 SmolLM2 on the few-row kernel, one thread: 8 decode rows are compute-bound, each more
    row ~12% of the step. A 0.6-acceptance draft pays alone, not beside 7 other decodes."""
    per_row = costs(0.12)
    assert best_length(0.6, 4, per_row, 1) > 0
    assert best_length(0.6, 4, per_row, 8) == 0
    assert best_length(0.97, 4, per_row, 8) > 0  # a copied passage still pays


def test_waiting_for_a_longer_draft_pays_only_against_what_is_at_hand():
    verifier = _costs({1: 0.024, 2: 0.044, 4: 0.054})  # fp32: the second row is the dear one
    assert wait_pays(0.95, 3, verifier, 1, wait_s=0.010, k_now=1)  # 3.7 in 64 ms beats 1.95 in 44
    assert not wait_pays(0.95, 3, verifier, 1, wait_s=0.040, k_now=1)
    assert not wait_pays(0.95, 1, verifier, 1, wait_s=0.0, k_now=1)  # nothing more to wait for


class _RemoteLike:
    """A proposer the drafter calls on its own thread (not inline); never called here."""

    name, inline = "remote-like", False

    def propose(self, requests, cancelled=None):
        raise AssertionError("not called")

    def release(self, seq_ids):
        pass


def test_a_slow_first_block_does_not_stop_drafting_for_good():
    """The drafter's D (call time by tokens drafted): a steady call (context of 1 token) sets it; a
    call after a plain stretch (it also prefilled 8 tokens) only lowers it, never raises it: one
    cold first call would otherwise keep every later probe from showing the proposer is fast."""
    from meshllm.engine.kv_cache import SeqId
    from meshllm.spec.drafter import Drafter, DraftsReady
    from meshllm.spec.proposer import Draft, ProposeRequest

    drafter = Drafter(_RemoteLike(), vocab_size=100, post=lambda message: None)
    try:
        def answered(context: int, seconds: float) -> None:
            request = ProposeRequest(SeqId(1), 10, tuple(range(context)), 3)
            drafter._observe_call(DraftsReady((request,), (0,), (Draft(SeqId(1), (5, 6, 7)),), seconds))

        answered(context=1, seconds=0.300)  # cold start
        assert drafter._draft_s.seconds(3) == pytest.approx(0.300)
        answered(context=8, seconds=0.060)  # a probe after a plain stretch: still much faster
        assert drafter._draft_s.seconds(3) < 0.300
        lowered = drafter._draft_s.seconds(3)
        answered(context=8, seconds=0.500)  # a slow probe (its prefill) says nothing new
        assert drafter._draft_s.seconds(3) == lowered
    finally:
        drafter.close()


def test_rows_past_the_measured_counts_cost_what_the_measured_line_says():
    """A fresh leader at batch 8 has measured 1 and 8 rows, not 9: a ninth row costs what the line
    through them says (1/8 of an 8-row step here), not the flat prior's 5%, so free text at ~0.6
    acceptance drafts nothing instead of paying for its first drafts."""
    measured = _costs({1: 0.007, 8: 0.027})
    assert measured.ratio(8, 1) == pytest.approx((0.027 + 0.020 / 7) / 0.027)
    assert best_length(0.6, 8, measured, 8) == 0
    # One count measured: no line yet, so the prior stands (batch 1 keeps drafting from the start).
    assert _costs({1: 0.007}).ratio(1, 1) == pytest.approx(1.05)
