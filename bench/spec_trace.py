"""Summarise a speculative-decoding trace (meshllm/spec/trace.py) as JSON, one object per drafter.

    MESHLLM_SPEC_TRACE=/tmp/spec.jsonl python bench/spec_two_machines.py ...  # any leader run
    python bench/spec_trace.py /tmp/spec.jsonl

Per drafter: decode steps by rows (count, median ms), verify outcomes (drafted, accepted) by
count, proposer calls by (tokens asked, drafted) with their median drafting ms, and recovery
after rejections: how long from a step that rejected part of a draft to the next step that
accepted any, and how many draftless steps went between (what a rejection costs in time); requests
by the block length chosen, how often a step was to be held for a draft (decisions, with the median
expected wait), and how late calls were answered against what was expected.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict


def summarise(events: list[list]) -> dict:
    steps = [e for e in events if e[0] == "step"]
    checks = [e for e in events if e[0] == "verified"]
    calls = [e for e in events if e[0] == "call"]
    by_rows = defaultdict(list)
    for _, _, rows, seconds in steps:
        by_rows[rows].append(seconds)
    by_call = defaultdict(list)
    for _, _, k, _, drafted, seconds, _ in calls:
        by_call[k, drafted].append(seconds)
    gaps, draftless = [], []
    i = 0
    while i < len(checks):
        _, t, drafted, accepted = checks[i]
        if drafted and accepted < drafted:
            j = i + 1
            while j < len(checks) and checks[j][3] == 0:
                j += 1
            if j < len(checks):
                gaps.append(checks[j][1] - t)
                draftless.append(j - i - 1)
            i = j
        else:
            i += 1
    span = checks[-1][1] - checks[0][1] if len(checks) > 1 else 0.0
    requests = Counter(e[2] for e in events if e[0] == "request")
    holds = [e[2] for e in events if e[0] == "hold"]
    late = _lateness(events)
    return {
        "steps_by_rows": {rows: {"count": len(s), "median_ms": round(1000 * statistics.median(s), 2)}
                          for rows, s in sorted(by_rows.items())},
        "verified_drafted_accepted": {f"{d},{a}": n for (d, a), n in sorted(Counter(
            (e[2], e[3]) for e in checks).items())},
        "calls_by_asked_drafted": {f"{k},{d}": {"count": len(s), "median_ms": round(1000 * statistics.median(s), 2)}
                                   for (k, d), s in sorted(by_call.items())},
        "requests_by_block_length": {str(k): n for k, n in sorted(requests.items())},
        "holds": len(holds),
        "hold_wait_median_ms": round(1000 * statistics.median(holds), 2) if holds else None,
        # How much later than expected calls were answered (negative: sooner), by quantile.
        "answer_late_ms": {f"p{q}": round(1000 * late[round(q / 100 * (len(late) - 1))], 1)
                           for q in (10, 50, 75, 90)} if late else None,
        "rejections": len(gaps),
        "recovery_median_ms": round(1000 * statistics.median(gaps), 1) if gaps else None,
        "recovery_draftless_steps_median": statistics.median(draftless) if draftless else None,
        "recovery_share_of_span": round(sum(gaps) / span, 3) if span else None,
    }


def _lateness(events: list[list]) -> list[float]:
    """Sorted seconds from each answered call's expected answer to its answer: each call against
    the last request of its position before it. Meant for batch 1 (the two-machine bench): several
    sequences share positions, and a call names only its first request's. Traces from before
    requests recorded their position give none."""
    last_request: dict[int, list] = {}
    late = []
    for e in events:
        if e[0] == "request" and len(e) > 7:
            last_request[e[7]] = e
        elif e[0] == "call":
            request = last_request.pop(e[6], None)
            if request is not None and request[5] is not None:
                late.append(e[1] - request[1] - request[5])
    return sorted(late)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    args = parser.parse_args()
    with open(args.path) as f:
        drafters = [json.loads(line) for line in f if line.strip()]
    print(json.dumps([{"proposer": d["proposer"], **summarise(d["events"])} for d in drafters], indent=1))


if __name__ == "__main__":
    main()
