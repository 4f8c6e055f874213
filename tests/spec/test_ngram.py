"""The n-gram proposer: longest suffix match, draft length growing with the match, incremental rollback."""

from __future__ import annotations

from meshllm.engine.kv_cache import SeqId
from meshllm.spec.ngram import NgramConfig, NgramProposer
from meshllm.spec.proposer import ProposeRequest

S = SeqId(7)


def ask(p: NgramProposer, position: int, tokens, k: int = 8):
    (draft,) = p.propose([ProposeRequest(S, position, tuple(tokens), k)])
    return draft


def test_copies_the_continuation_of_the_longest_earlier_match():
    p = NgramProposer()
    # "5 6 7" occurred before, followed by "8 9 1"; "7" alone also occurred before 3.
    context = [1, 2, 3, 7, 3, 4, 5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    draft = ask(p, 0, context, k=3)
    assert draft.tokens == (8, 9, 1)


def test_draft_length_grows_with_the_match_length():
    p = NgramProposer(NgramConfig(draft_per_matched_token=1.0))
    short = ask(p, 0, [10, 11, 12, 13, 14, 15, 99, 10])  # suffix "10" matches 1 token
    assert short.tokens == (11,)
    p.release([S])
    long = ask(p, 0, [10, 11, 12, 13, 14, 15, 99, 10, 11, 12, 13])  # suffix matches 4 tokens
    assert long.tokens == (14, 15, 99, 10)


def test_no_match_no_draft_and_k_caps_it():
    p = NgramProposer()
    assert ask(p, 0, [1, 2, 3, 4]).tokens == ()
    p.release([S])
    assert len(ask(p, 0, [1, 2, 3, 1, 2, 3, 1, 2, 3], k=2).tokens) == 2


def test_repeating_pattern_runs_past_the_context():
    # The suffix "4 5 4 5" matched at position 2 (4 tokens): its continuation runs into the draft itself.
    p = NgramProposer()
    assert ask(p, 0, [4, 5, 4, 5, 4, 5], k=6).tokens == (4, 5, 4, 5)


def test_rollback_and_extension_are_incremental_and_equal_to_a_fresh_index():
    p = NgramProposer()
    base = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    first = ask(p, 0, base, k=4)  # drafts 3 4 1 2, held as assumed context
    assert first.tokens == (3, 4, 1, 2)
    # The verifier took 3 then 9: roll back to position 11 and continue from the real tokens.
    rolled = ask(p, 11, [9, 1, 2], k=4)
    fresh = NgramProposer()
    expected = ask(fresh, 0, base + [3, 9, 1, 2], k=4)
    assert rolled.tokens == expected.tokens
    assert p._indexes[S].follows == fresh._indexes[S].follows


def test_unknown_sequence_or_gap_asks_for_a_resync():
    p = NgramProposer()
    assert ask(p, 5, [1, 2]).resync_from == 0
    ask(p, 0, [1, 2, 3], k=0)
    assert ask(p, 10, [4]).resync_from == 3
