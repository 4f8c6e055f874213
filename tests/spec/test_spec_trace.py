"""The opt-in drafting trace (MESHLLM_SPEC_TRACE) over a real leader on aidreams' weights, and
bench/spec_trace.py's summary of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from meshllm.engine.sampler import SamplingParams
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import local_leader
from meshllm.spec.ngram import NgramProposer
from meshllm.spec.trace import TRACE_ENV
from tests.spec.conftest import EXACT, PROMPTS
from tests.spec.test_speculative_identity import run_all

SUMMARY = Path(__file__).resolve().parents[2] / "bench" / "spec_trace.py"


def test_a_traced_leader_records_its_steps_checks_and_calls(aidreams_path, tmp_path, monkeypatch):
    path = tmp_path / "spec.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    files = open_model(aidreams_path)
    prompts = [files.tokenizer.encode(p) for p in PROMPTS]
    leader = local_leader(files, EXACT, proposer=NgramProposer())
    try:
        outputs = run_all(leader, prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    finally:
        leader.close()
    (line,) = path.read_text().splitlines()  # one drafter, one line, written when it closed
    record = json.loads(line)
    assert record["proposer"] == "ngram"
    kinds = {e[0] for e in record["events"]}
    # An inline proposer's steps are never held for its drafts.
    assert kinds == {"step", "verified", "call", "request"}
    checks = [e for e in record["events"] if e[0] == "verified"]
    # Every generated token came from a checked step (the prompt's last chunk's one too): its
    # accepted draft tokens plus the verifier's own.
    committed = sum(1 + accepted for _, _, _, accepted in checks)
    assert committed == sum(len(o) for o in outputs)
    (summary,) = json.loads(subprocess.run([sys.executable, str(SUMMARY), str(path)], capture_output=True,
                                           text=True, check=True, timeout=60).stdout)
    assert summary["proposer"] == "ngram"
    assert sum(s["count"] for s in summary["steps_by_rows"].values()) == len([e for e in record["events"]
                                                                             if e[0] == "step"])
    assert sum(summary["verified_drafted_accepted"].values()) == len(checks)
    assert summary["calls_by_asked_drafted"]
    requests = [e for e in record["events"] if e[0] == "request"]
    assert requests and all(k >= 1 and 0 <= block <= 8 for _, _, block, k, *_ in requests)  # k_max 8
    # An inline proposer answers each request at once, in one call each.
    assert len(requests) == len([e for e in record["events"] if e[0] == "call"])
    assert sum(summary["requests_by_block_length"].values()) == len(requests)
    # An inline proposer's answer is there at once: never much later than expected.
    assert summary["answer_late_ms"] is None or summary["answer_late_ms"]["p50"] < 50
    assert summary["holds"] == 0


def test_no_trace_unless_asked(aidreams_path, tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    files = open_model(aidreams_path)
    leader = local_leader(files, EXACT, proposer=NgramProposer())
    try:
        assert leader.drafter._trace is None
    finally:
        leader.close()
