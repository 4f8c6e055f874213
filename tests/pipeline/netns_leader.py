"""Leader side of the network-namespace test, run inside a namespace by the test:

    python -m tests.pipeline.netns_leader MODEL KEY_FILE STAGE0 STAGE1 SPLIT MAX_TOKENS PROMPT_IDS_JSON

Deploys a two-stage plan (stage 0 on STAGE0, stage 1 reached at STAGE1), generates
greedily and prints {"tokens": [...], "seconds": s} as one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from meshllm.cluster.gossip import fetch_view
from meshllm.cluster.placement import Plan, StageAssignment
from meshllm.engine.sampler import SamplingParams
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import leader_for_plan
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool
from tests.pipeline.conftest import OPTIONS


def main(model: str, key_file: str, stage0: str, stage1: str, split: int, max_tokens: int, prompt: list[int]) -> None:
    files = open_model(model)
    key = load_key(Path(key_file))
    fingerprint = files.source.fingerprint()
    deadline = time.monotonic() + 60
    for address in (stage0, stage1):  # each node (peerless: its view is its own card) must have scanned
        while not any(m.fingerprint == fingerprint for c in fetch_view(address, key) for m in c.models):
            if time.monotonic() > deadline:
                raise SystemExit(f"{address} never advertised the model")
            time.sleep(0.2)
    channels = ChannelPool(ChannelConfig("netns-leader", key))
    n = files.config.num_hidden_layers
    stages = (StageAssignment("a", stage0, 0, split, 0, 0, 0), StageAssignment("b", stage1, split, n, 0, 0, 0))
    plan = Plan(files.model_id, fingerprint, n, OPTIONS.context_length, OPTIONS.max_batch, 4, 4, stages, 0.0, False)
    leader = leader_for_plan(files, plan, channels, OPTIONS)
    started = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [e.token_id for e in leader.generate(prompt, params) if e.token_id is not None]
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - started}), flush=True)
    leader.close()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], a[3], int(a[4]), int(a[5]), json.loads(a[6]))
