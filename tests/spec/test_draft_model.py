"""A draft model as a proposer, on aidreams' real weights in the batch-invariant mode (every
pass gives a row the bits of a one-row pass, so drafts can be compared with greedy decoding)."""

from __future__ import annotations

import torch

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.source import open_model
from meshllm.spec.draft_model import DraftModelProposer
from meshllm.spec.proposer import ProposeRequest


def _greedy(decoder, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(decoder.forward_full(torch.tensor(ids))[-1].argmax()))
    return ids[-n:]


def test_drafts_continue_greedily_and_a_short_catch_up_costs_no_forward_of_its_own(aidreams_path):
    """After a plain stretch the leader sends the few tokens committed meanwhile with its request:
    they ride in the first draft round, so drafting k tokens takes k forwards (it took k + 1)."""
    files = open_model(aidreams_path)
    decoder = load_stage_decoder(files.source, files.config, dtype=torch.float32, batch_invariant=True)
    proposer = DraftModelProposer(decoder, "aidreams")
    forwards = []
    forward = decoder.forward
    decoder.forward = lambda *a, **kw: forwards.append(a[0].numel()) or forward(*a, **kw)
    prompt = files.tokenizer.encode("Once upon a time, there was a little robot. The robot liked to")
    first, = proposer.propose([ProposeRequest(SeqId(1), 0, tuple(prompt), 3)])
    assert list(first.tokens) == _greedy(decoder, prompt, 3)

    # Plain steps committed 4 more tokens (the verifier's own, here: greedy ones) before the next
    # call: the first 3 are the drafted ones, whose KV the proposer holds but for the last.
    committed = prompt + _greedy(decoder, prompt, 4)
    expected = _greedy(decoder, committed, 2)
    forwards.clear()
    second, = proposer.propose([ProposeRequest(SeqId(1), len(prompt), tuple(committed[len(prompt):]), 2)])
    assert list(second.tokens) == expected
    # The 2 tokens the KV lacks and the first draft in one forward, then one for the second draft.
    assert forwards == [2, 1]


def test_a_cancelled_call_stops_drafting_and_the_next_one_carries_on(aidreams_path):
    """`cancelled` is asked between forward passes (a proposer node's gRPC call that went away):
    drafting stops there, and what was drafted stays held, so the next call continues greedily."""
    files = open_model(aidreams_path)
    decoder = load_stage_decoder(files.source, files.config, dtype=torch.float32, batch_invariant=True)
    proposer = DraftModelProposer(decoder, "aidreams")
    prompt = files.tokenizer.encode("Once upon a time, there was a little robot. The robot liked to")
    rounds = []
    stop_after_two = lambda: len(rounds) >= 2  # noqa: E731
    forward = decoder.forward
    decoder.forward = lambda *a, **kw: rounds.append(1) or forward(*a, **kw)
    cut, = proposer.propose([ProposeRequest(SeqId(1), 0, tuple(prompt), 6)], cancelled=stop_after_two)
    expected = _greedy(decoder, prompt, 5)
    assert list(cut.tokens) == expected[:2]
    rest, = proposer.propose([ProposeRequest(SeqId(1), len(prompt) + 2, (), 3)])
    assert list(rest.tokens) == expected[2:]
