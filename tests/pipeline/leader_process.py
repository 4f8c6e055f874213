"""A leader in a process of its own, for tests and benchmarks that kill it (kill -9) mid-stream:

    python -m tests.pipeline.leader_process MODEL KEY_FILE MAX_TOKENS NUM_SEQS STAGE_ADDRESS...

Places the model's layers evenly over the given stage nodes (stage i on the i-th address),
starts NUM_SEQS greedy sequences of MAX_TOKENS tokens (EOS ignored) and prints one JSON line
{"plan_id": ..., "generating": true} once every sequence has its first token, then one line
per later token. Exits when they finish.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
from pathlib import Path

from meshllm.cluster.gossip import fetch_view
from meshllm.cluster.placement import Plan, StageAssignment
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions, leader_for_plan, wait_for_fleet
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool

OPTIONS = ServingOptions(context_length=512, max_batch=4, dtype="float32",
                         scheduler=SchedulerConfig(max_batched_tokens=64, prefill_chunk=32, prefix_block_size=16))


LEADER_ID = "killable-leader"


def even_plan(files, addresses: list[str]) -> Plan:
    """The model's layers evenly over the stage nodes (stage i on the i-th address): what this
    leader loads (with OPTIONS), so another leader can load the same plan."""
    n = files.config.num_hidden_layers
    bounds = [round(k * n / len(addresses)) for k in range(len(addresses) + 1)]
    stages = tuple(StageAssignment(f"node-{k}", a, bounds[k], bounds[k + 1], 0, 0, 0) for k, a in enumerate(addresses))
    context = min(OPTIONS.context_length, files.config.max_position_embeddings)
    return Plan(files.model_id, files.source.fingerprint(), n, context, OPTIONS.max_batch, 4, 4, stages, 0.0, False)


def main(model: str, key_file: str, max_tokens: int, num_seqs: int, addresses: list[str]) -> None:
    files = open_model(model)
    key = load_key(Path(key_file))
    wait_for_fleet(lambda: fetch_view(addresses[0], key), files.source.fingerprint(), len(addresses), 60)
    plan = even_plan(files, addresses)
    leader = leader_for_plan(files, plan, ChannelPool(ChannelConfig(LEADER_ID, key)), OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    events: queue.Queue = queue.Queue()
    prompt = files.tokenizer.encode("Once upon a time, in a small town by the sea,")
    for _ in range(num_seqs):
        leader.submit(prompt, params, events.put)
    started, finished = set(), 0
    while finished < num_seqs:
        event = events.get()
        if event.token_id is not None and event.seq_id not in started:
            started.add(event.seq_id)
            if len(started) == num_seqs:
                print(json.dumps({"plan_id": leader.transport.plan_id, "generating": True}), flush=True)
        elif len(started) == num_seqs:
            print(json.dumps({"token": event.token_id}), flush=True)
        finished += event.finish_reason is not None
    leader.close()


def spawn(model: Path, key_file: Path, max_tokens: int, num_seqs: int, addresses: list[str]) -> subprocess.Popen:
    """This module as a process (one thread), its JSON lines on stdout; the caller kills it."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.pipeline.leader_process", str(model), str(key_file), str(max_tokens),
         str(num_seqs), *addresses],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), a[4:])
