"""Constrained decoding composes with draft verification: the leader cuts a draft at the first
token the grammar rejects, ships one mask per scored row and keeps its matcher at the committed
tokens; the last stage picks per row exactly what plain constrained decoding picks there."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from meshllm.engine.grammar import GrammarCompiler, allows
from meshllm.engine.kv_cache import SeqId
from meshllm.engine.logit_processors import PenaltyCounts
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.step import SeqWork
from meshllm.model.source import open_model
from meshllm.pipeline.seq_constraints import SeqConstraints
from meshllm.spec.verify import choose_tokens

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
GREEDY = SamplingParams(temperature=0.0, seed=1)


def _doc_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[1:] if tokenizer.token_bytes[ids[0]] == b" " else ids


def test_draft_is_cut_at_the_first_rejected_token_and_matcher_keeps_committed_state(aidreams_path):
    tokenizer = open_model(aidreams_path).tokenizer
    compiler = GrammarCompiler(tokenizer)
    constraints = SeqConstraints(GREEDY, [1, 2, 3], compiler.matcher(compiler.json_schema(SCHEMA)))
    good = _doc_ids(tokenizer, '{"name": "Al')
    wrong = tokenizer.backend.token_to_id("<0x0A>")  # a raw newline cannot be inside a JSON string
    before = constraints.matcher.allowed()
    draft, penalties, masks = constraints.inputs(tuple(good + [wrong] + good[:2]))
    assert draft == tuple(good) and len(masks) == len(good) + 1
    assert penalties == PenaltyCounts()
    assert np.array_equal(constraints.matcher.allowed(), before)  # rolled back to the committed tokens
    for token, mask in zip(good, masks):
        assert allows(mask.numpy(), token)


def test_a_draft_with_probabilities_keeps_its_rejected_token_for_its_row_to_reject(aidreams_path):
    # Speculative sampling must reject it there (the mask makes p zero) and draw from the
    # residual; cutting the draft and drawing from p because of what was drafted biases the output.
    tokenizer = open_model(aidreams_path).tokenizer
    compiler = GrammarCompiler(tokenizer)
    constraints = SeqConstraints(GREEDY, [1, 2, 3], compiler.matcher(compiler.json_schema(SCHEMA)))
    good = _doc_ids(tokenizer, '{"name": "Al')
    wrong = tokenizer.backend.token_to_id("<0x0A>")
    before = constraints.matcher.allowed()
    draft, _, masks = constraints.inputs(tuple(good + [wrong] + good[:2]), keep_rejected=True)
    assert draft == tuple(good + [wrong]) and len(masks) == len(draft) + 1
    assert not allows(masks[len(good)].numpy(), wrong)  # its row rejects it
    assert np.array_equal(constraints.matcher.allowed(), before)
    # An id past the mask (a proposer's bad id) is rejected too, not an IndexError.
    assert constraints.inputs((32 * len(before) + 5,))[0] == ()


def test_a_draft_ending_a_document_with_eos_leaves_the_matcher_at_the_committed_tokens(aidreams_path):
    # llguidance's rollback over a stop token takes back the token before it: walking EOS then
    # rolling back left the matcher after '5', so the committed '}' was refused (the request
    # ended in an error) or later masks came from the wrong state.
    tokenizer = open_model(aidreams_path).tokenizer
    compiler = GrammarCompiler(tokenizer)
    constraints = SeqConstraints(GREEDY, [1], compiler.matcher(compiler.json_schema(SCHEMA)))
    body = _doc_ids(tokenizer, '{"name": "Al", "n": 5}')
    for token in body[:-1]:
        assert constraints.commit(token) is None
    [eos] = tokenizer.eos_token_ids[:1]
    for drafted in ((eos,), (body[-1], eos, body[0])):
        before = constraints.matcher.allowed()
        draft, _, masks = constraints.inputs(drafted)
        assert np.array_equal(constraints.matcher.allowed(), before)
        if drafted[0] == eos:  # the document is not complete before '}': EOS is not allowed there
            assert draft == () and len(masks) == 1
            continue
        assert draft == (body[-1], eos) and len(masks) == 3
        assert allows(masks[1].numpy(), eos) and not allows(masks[0].numpy(), eos)
        assert [t for t in range(32 * len(masks[2])) if allows(masks[2].numpy(), t)] == [eos]  # what follows EOS
    assert constraints.commit(body[-1]) is None and constraints.commit(eos) is None


def test_verification_with_masks_picks_what_plain_constrained_decoding_picks(aidreams_path):
    tokenizer = open_model(aidreams_path).tokenizer
    compiler = GrammarCompiler(tokenizer)
    vocab = tokenizer.vocab_size
    draft_text = _doc_ids(tokenizer, '{"name": "Al')
    partial = 0
    for seed in range(12):
        constraints = SeqConstraints(GREEDY, [1], compiler.matcher(compiler.json_schema(SCHEMA)))
        draft, _, masks = constraints.inputs(tuple(draft_text))
        logits = torch.randn(len(masks), vocab, generator=torch.Generator().manual_seed(seed))
        agree = seed % len(draft)  # rows before this one prefer the draft token
        for i in range(agree):
            logits[i, draft[i]] = 50.0
        work = SeqWork(SeqId(7), start=10, num_tokens=1 + len(draft), num_scored=1 + len(draft), sampling=GREEDY,
                       draft=draft, allowed=masks)
        tokens = choose_tokens(logits, [work])
        # plain constrained decoding, row by row: argmax over the allowed tokens; drafts accepted while equal
        plain = []
        for i, mask in enumerate(masks):
            allowed = [t for t in range(vocab) if allows(mask.numpy(), t)]
            plain.append(allowed[int(logits[i, allowed].argmax())])
            if i == len(draft) or plain[-1] != draft[i]:
                break
        assert [t.token_id for t in tokens] == plain
        first = work.first_new_position
        assert [t.position for t in tokens] == list(range(first, first + len(plain)))
        partial += 0 < len(plain) - 1 < len(draft)
    assert partial  # some drafts were accepted in part


def test_penalty_rows_count_the_draft_before_them():
    params = SamplingParams(temperature=0.0, seed=1, presence_penalty=1.0)
    counts = PenaltyCounts.of(params, [5], Counter({9: 1}))
    work = SeqWork(SeqId(1), start=4, num_tokens=3, num_scored=3, sampling=params, draft=(9, 8), penalties=counts)
    rows = work.row_inputs()
    assert [dict(zip(r.penalties.ids, r.penalties.counts)) for r in rows] == [{9: 1}, {9: 2}, {9: 2, 8: 1}]
