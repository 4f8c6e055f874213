"""A bounded soak (bench/soak.py with 40 requests): a 3-stage cluster of node processes serving
SmolLM2 over HTTP with the official `openai` client, 8 at once, mixed lengths, streaming and
not, some cancelled mid-stream. Nothing is lost or hung, every node's resident memory comes
back within 10% of its post-warm-up baseline, and a leader process killed (kill -9) mid-stream
leaves no KV on the stages. The full 300-request run is `python bench/soak.py`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cluster_fixtures import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_forty_mixed_requests_through_three_stages_lose_nothing_and_leak_nothing(smollm2_gguf_path):
    run = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "soak.py"), "--requests", "40",
                          "--concurrency", "8", "--max-tokens", "24", "--model", str(smollm2_gguf_path)],
                         capture_output=True, text=True, timeout=540, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(report))
    requests = report["requests"]
    assert requests["lost"] == 0 and requests["hung"] == 0, report
    assert requests["ok"] + requests["cancelled"] == 40 and requests["cancelled"] > 0 and requests["ok"] > 0
    assert report["warmup"]["lost"] == report["warmup"]["hung"] == 0
    assert all(r <= 1.10 for r in report["memory"]["ratio"]), report["memory"]
    kill = report["killed_leader"]
    assert kill["sequences_held_at_kill"] == 2 * 3 and kill["left_after"] == 0 and kill["freed_within_s"] < 10
    assert report["still_serving"] == "ok", report
