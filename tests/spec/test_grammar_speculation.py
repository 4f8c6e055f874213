"""Speculation under a grammar (response_format, forced tool calls) is exact too. A proposer
that knows the answer drafts the document's closing tokens and EOS together: the leader walks its
grammar matcher along the draft and rolls it back, and a stop token walked and rolled back took
back the token before it instead (llguidance), so the committed '}' was refused and the request
ended in an error."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshllm.engine.grammar import GrammarCompiler
from meshllm.engine.sampler import SamplingParams
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import local_leader
from meshllm.spec.drafter import SpecConfig
from meshllm.spec.proposer import Draft
from tests.spec.conftest import EXACT

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "bb"]}},
          "required": ["ok", "tag"], "additionalProperties": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


class Oracle:
    """Drafts what the plain run produced next, EOS included: every draft is right."""

    name = "oracle"

    def __init__(self, sequence: list[int]):
        self.sequence = sequence
        self.drafted_eos = False

    def propose(self, requests, cancelled=None):
        out = []
        for r in requests:
            end = r.position + len(r.tokens)
            draft = tuple(self.sequence[end:end + r.k])
            self.drafted_eos |= bool(draft) and draft[-1] == self.sequence[-1]
            out.append(Draft(r.seq_id, draft))
        return out

    def release(self, seq_ids) -> None:
        pass


def _run(files, prompt, proposer=None) -> tuple[list[int], str]:
    options = replace(EXACT, spec=SpecConfig(wait_for_drafts=True)) if proposer else EXACT
    leader = local_leader(files, options, proposer=proposer)
    compiler = GrammarCompiler(files.tokenizer)
    try:
        events = list(leader.generate(prompt, GREEDY, grammar=compiler.matcher(compiler.json_schema(SCHEMA))))
    finally:
        leader.close()
    assert events[-1].error is None, events[-1].error
    return [e.token_id for e in events if e.token_id is not None], events[-1].finish_reason


@pytest.mark.parametrize("prompt_text", ["Once upon a time", "The answer is"])
def test_drafts_that_end_the_document_with_eos_give_the_plain_output(aidreams_path, prompt_text):
    files = open_model(aidreams_path)
    prompt = files.tokenizer.encode(prompt_text)
    tokens, finish = _run(files, prompt)
    assert finish == "stop"
    [eos] = files.tokenizer.eos_token_ids[:1]
    oracle = Oracle(prompt + tokens + ([eos] if not tokens or tokens[-1] != eos else []))
    assert _run(files, prompt, oracle) == (tokens, finish)
    assert oracle.drafted_eos
