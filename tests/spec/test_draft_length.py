"""Adaptive draft length: what is sent of a self-sized (n-gram) offer follows acceptance per
offered length and the measured cost of extra rows; no model, microseconds."""

from __future__ import annotations

from meshllm.spec.draft_length import DraftLength, DraftLengthConfig, OfferedLength, StepCosts

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
    sent = [lengths.send_length(1, rows_cost, 1) for _ in range(2 * CONFIG.probe_every)]
    assert sent.count(1) == 2 and sent.count(0) == 2 * CONFIG.probe_every - 2  # only the probes go out


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
