"""Serving benchmark through the 2-stage demo cluster (two `meshllm node` processes on
loopback, SmolLM2-135M-Instruct): throughput, TTFT and inter-token latency p50/p95 at
concurrency 1, 4 and 16 with mixed prompt lengths, and TTFT with a 512-token prefix hit
against a miss; and the cost of constrained decoding: decode tok/s of json_schema replies
against plain ones, and of free-text replies under a strict tool (tool_choice auto) against the
same tool not strict, at concurrency 1 and 16 (each reply's decode rate, prefill excluded),
rounds alternated so all see the same machine.
Real HTTP, the real `openai` client, streaming. Prints one JSON object.

    python bench/serve.py [--dtype float32] [--max-tokens 64] [--threads 1] [--only constrained]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from openai import OpenAI

from meshllm.api.app import create_app
from meshllm.api.cluster_backend import local_cluster_backend
from meshllm.api.config import APIConfig
from meshllm.api.server import APIServer
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions
from meshllm.pipeline.local_cluster import LocalCluster

WORDS = ("the cluster of small machines serves one model together while each node holds a few layers "
         "and passes hidden states onward over the local network").split()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def one_request(client: OpenAI, model: str, prompt, max_tokens: int) -> dict:
    started = time.perf_counter()
    stamps = []
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - started, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": max_tokens, "end": time.perf_counter(), "start": started}


def in_threads(target, concurrency: int) -> float:
    """Run `target` in `concurrency` threads at once; the wall time until all are done."""
    threads = [threading.Thread(target=target) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def load_at(client: OpenAI, model: str, concurrency: int, requests_per_client: int, max_tokens: int,
            rng: random.Random) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(requests_per_client):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice((8, 32, 96, 200))))  # mixed lengths
            r = one_request(client, model, prompt, max_tokens)
            with lock:
                results.append(r)

    wall = in_threads(worker, concurrency)
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    return {"requests": len(results), "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p95_ms": 1e3 * percentile(ttft, 0.95),
            "itl_p50_ms": 1e3 * percentile(itl, 0.5), "itl_p95_ms": 1e3 * percentile(itl, 0.95)}


def prefix_ttft(client: OpenAI, model: str, tokenizer) -> dict:
    rng = random.Random(7)
    prefix = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(600)))[:512]
    misses, hits = [], []
    for i in range(3):
        base = [t for t in prefix]
        base[1] = 100 + i  # a fresh prefix each round: the first request misses
        misses.append(one_request(client, model, base + [200, 201, 202 + i], 1)["ttft"])
        hits.append(one_request(client, model, base + [300, 301, 302 + i], 1)["ttft"])
    miss, hit = percentile(misses, 0.5), percentile(hits, 0.5)
    return {"prefix_tokens": 512, "ttft_miss_ms": 1e3 * miss, "ttft_hit_ms": 1e3 * hit, "hit_over_miss": hit / miss}


# A document of ~64 tokens whatever the model prefers: eight bounded strings.
CONSTRAINED_FORMAT = {"type": "json_schema", "json_schema": {"name": "list", "strict": True, "schema": {
    "type": "object", "properties": {"items": {"type": "array", "minItems": 8, "maxItems": 8,
                                               "items": {"type": "string", "minLength": 4, "maxLength": 12}}},
    "required": ["items"], "additionalProperties": False}}}


# A strict function under tool_choice auto: the free-text reply runs under the text-or-call grammar.
STRICT_TOOL = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
LOOSE_TOOL = {"type": "function", "function": {**STRICT_TOOL["function"], "strict": False}}
# Each constrained mode against the plain one with the same prompt: the tool's definition makes the
# prompt longer (its system text), so a strict tool is measured against the same tool not strict.
MODES = {"plain": {"extra_body": {"ignore_eos": True}}, "json_schema": {"response_format": CONSTRAINED_FORMAT},
         "loose_tool": {"tools": [LOOSE_TOOL], "extra_body": {"ignore_eos": True}},
         "strict_tool": {"tools": [STRICT_TOOL], "extra_body": {"ignore_eos": True}}}
BASELINE = {"json_schema": "plain", "strict_tool": "loose_tool"}


def decode_rate(client: OpenAI, model: str, max_tokens: int, mode: str) -> tuple[int, float]:
    """(tokens, seconds) of one streamed chat reply after its first token (prefill excluded)."""
    extra = MODES[mode]
    stamps, tokens = [], 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "List eight fruits as JSON."}], temperature=0,
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens - 1, stamps[-1] - stamps[0]


def constrained_overhead(client: OpenAI, model: str, max_tokens: int, rounds: int = 3) -> dict:
    out = {}
    for concurrency in (1, 16):
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(rounds):
            for mode in MODES:
                results: list[tuple[int, float]] = []
                in_threads(lambda m=mode: results.append(decode_rate(client, model, max_tokens, m)), concurrency)
                # Each reply's own decode rate (prefill excluded: the modes' prompts and reply lengths
                # differ, so an aggregate over the round's wall time compared prefills too), the
                # median over the round's replies; times the concurrency, the aggregate.
                rates[mode].append(concurrency * percentile([n / s for n, s in results], 0.5))
        row = out[str(concurrency)] = {}
        for mode in MODES:
            row.update({f"{mode}_tok_s": percentile(rates[mode], 0.5), f"{mode}_rounds": rates[mode]})
        for mode, baseline in BASELINE.items():
            row[f"{mode}_loss"] = 1 - row[f"{mode}_tok_s"] / row[f"{baseline}_tok_s"]
        print(json.dumps({"constrained": {concurrency: out[str(concurrency)]}}), file=sys.stderr, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node process")
    parser.add_argument("--model", default=None)
    parser.add_argument("--only", choices=["constrained"], default=None, help="run only this part")
    args = parser.parse_args()
    files = open_model(args.model)
    with tempfile.TemporaryDirectory() as state:
        cluster = LocalCluster(2, [files.path], Path(state), threads_per_node=args.threads)
        cluster.start()
        backend = server = None
        try:
            options = ServingOptions(context_length=2048, max_batch=16, num_stages=2, dtype=args.dtype,
                                     scheduler=SchedulerConfig(max_batched_tokens=512, prefill_chunk=256))
            backend, _, _ = local_cluster_backend(cluster, files, options, "bench")
            server = APIServer(create_app(backend, APIConfig(port=0)), "127.0.0.1", 0)
            server.start()
            client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
            one_request(client, files.model_id, "warm up", 4)
            rng = random.Random(0)
            out = {"model": files.model_id, "dtype": args.dtype, "stages": 2, "threads_per_node": args.threads,
                   "max_tokens": args.max_tokens, "concurrency": {}}
            out["constrained_decoding"] = constrained_overhead(client, files.model_id, 96)
            for concurrency in () if args.only else (1, 4, 16):
                out["concurrency"][str(concurrency)] = load_at(client, files.model_id, concurrency,
                                                               max(1, 8 // concurrency), args.max_tokens, rng)
                print(json.dumps({concurrency: out["concurrency"][str(concurrency)]}), file=sys.stderr, flush=True)
            c = out["concurrency"]
            if not args.only:
                out["aggregate_16_over_1"] = c["16"]["tokens_per_s"] / c["1"]["tokens_per_s"]
                out["prefix_cache"] = prefix_ttft(client, files.model_id, files.tokenizer)
        finally:
            if server is not None:
                server.stop()
            if backend is not None:
                backend.close()
            cluster.stop()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
