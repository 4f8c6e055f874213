"""Chaos benchmark: faults injected into a 3-stage pipeline of `meshllm node` processes (plus one
spare) while several requests stream through the HTTP API with the real `openai` client.

Faults: kill -9 of the first, middle or last stage, SIGSTOP of the middle stage, corrupt
activations from the middle stage (MESHLLM_FAULT_INJECTION). For each: requests in flight,
requests completed with text identical to the single-process run (batch-invariant fp32),
and the recovery from the failure to the next token, split into detect, re-plan, load and
re-prefill (the leader's own timings, /v1/cluster). Goals (issue 8): no request lost;
a hung stage detected within 2 s on loopback; recovery <= load + re-prefill + 1 s.

    flock -x /work/cpu.lock python bench/chaos.py [--model PATH] [--requests 4] [--max-tokens 32]
                                                  [--prompt-tokens N]

--prompt-tokens makes each prompt about N tokens long (a long context shows what the re-prefill
costs, and what the stages that carried their KV over, see carried_positions, saved).

Prints one JSON object. Each fault gets a fresh cluster of 4 nodes (one thread each).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

from meshllm.api.app import create_app
from meshllm.api.backend import build_local_backend
from meshllm.api.cluster_backend import build_cluster_backend
from meshllm.api.config import APIConfig
from meshllm.api.server import APIServer
from meshllm.cluster.gossip import fetch_view
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions, wait_for_fleet
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool

PROMPTS = ["The old lighthouse keeper", "In a small village by the sea", "The robot opened its eyes and",
           "Once upon a time", "The recipe calls for", "Deep in the forest", "The spaceship landed",
           "My grandmother always said"]
FAULTS = ("kill_first", "kill_middle", "kill_last", "sigstop_middle", "corrupt_middle")
FAULT_AFTER_TOKENS = 8


class Server:
    def __init__(self, backend):
        self.backend = backend
        self.api = APIServer(create_app(backend, APIConfig(port=0)), "127.0.0.1", 0)
        self.api.start()
        self.client = OpenAI(base_url=f"{self.api.url}/v1", api_key="none", max_retries=0, timeout=600)

    def stream(self, prompt: str, max_tokens: int, on_token=lambda n: None) -> str:
        text, n = "", 0
        for chunk in self.client.completions.create(model=self.backend.model_id, prompt=prompt, max_tokens=max_tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].text:
                text += chunk.choices[0].text
                n += 1
                on_token(n)
        return text

    def cluster_view(self) -> dict:
        return httpx.get(f"{self.api.url}/v1/cluster", timeout=10).json()

    def close(self) -> None:
        self.api.stop()
        self.backend.close()


def run_fault(fault: str, files, model_path: Path, options: ServingOptions, references: list[str],
              prompts: list[str], max_tokens: int) -> dict:
    position = {"first": 0, "middle": 1, "last": 2}[fault.rsplit("_", 1)[1]]
    env = {1: {"MESHLLM_FAULT_INJECTION": f"corrupt@{FAULT_AFTER_TOKENS + 2}"}} if fault == "corrupt_middle" else {}
    with tempfile.TemporaryDirectory(prefix="meshllm-chaos-") as state:
        cluster = LocalCluster(4, [model_path], Path(state), extra_args=("--gossip-interval", "0.3"),
                               threads_per_node=1, node_env=env)
        cluster.start()
        server = None
        try:
            key = load_key(cluster.key_file)
            wait_for_fleet(lambda: fetch_view(cluster.live_addresses()[0], key), files.source.fingerprint(), 4)
            visible = {"node-0", "node-1", "node-2"}  # stages in node order; node-3 joins as the spare

            def view():
                for address in cluster.live_addresses():
                    try:
                        return [c for c in fetch_view(address, key, timeout=2) if c.node_id in visible]
                    except Exception:  # noqa: BLE001 - a stopped node does not answer: ask the next
                        continue
                return []

            backend, owner = build_cluster_backend(files, view, ChannelPool(ChannelConfig("chaos", key)), options)
            stages = [s.node_id for s in owner.plan.stages]
            assert stages == ["node-0", "node-1", "node-2"], stages
            visible.add("node-3")
            server = Server(backend)
            victim = cluster.processes[position]
            injected_at: list[float] = []

            def inject(n: int) -> None:
                if n != FAULT_AFTER_TOKENS or injected_at:
                    return
                injected_at.append(time.monotonic())
                if fault.startswith("kill"):
                    os.kill(victim.pid, signal.SIGKILL)
                elif fault.startswith("sigstop"):
                    os.kill(victim.pid, signal.SIGSTOP)

            results: list[str | Exception] = [None] * len(prompts)

            def request(i: int) -> None:
                try:
                    results[i] = server.stream(prompts[i], max_tokens, inject if i == 0 else lambda n: None)
                except Exception as e:  # noqa: BLE001 - counted as a lost request
                    results[i] = e

            threads = [threading.Thread(target=request, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=600)
            if fault.startswith("sigstop"):
                os.kill(victim.pid, signal.SIGCONT)
            view_json = server.cluster_view()["served"]
            recoveries = view_json["recent_failovers"]
            return {
                "fault": fault, "victim": f"node-{position}", "requests_in_flight": len(prompts),
                "requests_completed_correctly": sum(r == ref for r, ref in zip(results, references)),
                "requests_failed": [str(r)[:200] for r in results if isinstance(r, Exception)],
                "failovers": len(recoveries), "recovery": recoveries,
                "plan_after": [s["node_id"] for s in view_json["health"]["stages"]],
                "health_after": view_json["health"]["status"],
            }
        finally:
            if server is not None:
                server.close()
            cluster.stop()


def long_prompt(files, start: str, num_tokens: int) -> str:
    """`start` followed by filler text up to about `num_tokens` tokens (as is when 0)."""
    filler = " The committee met again to review the harbour's accounts, line by line, before the winter."
    text = start
    while num_tokens and len(files.tokenizer.encode(text)) < num_tokens:
        text += filler
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the demo's SmolLM2-135M GGUF)")
    parser.add_argument("--requests", type=int, default=4, help="concurrent streaming requests (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {FAULTS}")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="lengthen each prompt to about this many tokens")
    args = parser.parse_args()
    files = open_model(args.model)
    context = max(256, 2 ** (args.prompt_tokens + args.max_tokens + 16).bit_length())
    options = ServingOptions(context_length=context, max_batch=8, dtype="float32", batch_invariant=True,
                             num_stages=3, scheduler=SchedulerConfig(max_batched_tokens=128, prefill_chunk=64,
                                                                     prefix_block_size=16))
    prompts = [long_prompt(files, p, args.prompt_tokens) for p in PROMPTS[:args.requests]]
    local = build_local_backend(files.path, options)
    reference_server = Server(local)
    try:
        references = [reference_server.stream(p, args.max_tokens) for p in prompts]
    finally:
        reference_server.close()
    report = {"model": files.model_id, "dtype": "float32", "batch_invariant": True, "stages": 3, "spares": 1,
              "max_tokens": args.max_tokens, "fault_after_tokens": FAULT_AFTER_TOKENS,
              "prompt_tokens": [len(files.tokenizer.encode(p)) for p in prompts], "faults": []}
    for fault in args.faults.split(","):
        report["faults"].append(run_fault(fault, files, files.path, options, references, prompts, args.max_tokens))
        print(json.dumps(report["faults"][-1]), file=sys.stderr, flush=True)
    faults = report["faults"]
    report["summary"] = {
        "requests_in_flight": sum(f["requests_in_flight"] for f in faults),
        "requests_completed_correctly": sum(f["requests_completed_correctly"] for f in faults),
        "requests_lost": sum(f["requests_in_flight"] - f["requests_completed_correctly"] for f in faults),
        "hung_stage_detect_s": [r["detect_s"] for f in faults if f["fault"].startswith("sigstop")
                                for r in f["recovery"]],
        "recovery_over_load_plus_reprefill_s": [round(r["total_s"] - r["load_s"] - r["reprefill_s"], 3)
                                                for f in faults for r in f["recovery"]],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
