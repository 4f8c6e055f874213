"""Pipeline benchmark: decode tok/s at batch 1 for 1, 2 and 3 stages (each a `meshllm node`
process on loopback with the same torch threads), per-hop transport latency, and aggregate
tok/s at 1, 4 and 16 concurrent sequences; beside it, in the same run, llama.cpp's RPC mode on
the same GGUF: two ggml-rpc-server processes with the same thread count each, the layers split
evenly over them by llama-bench (-ngl 99), and llama-bench in one process as the no-split
reference. Prints one JSON object (`--out` also writes it to a file).

    flock -x /work/cpu.lock python bench/pipeline.py [--model tiny:BF16|tiny:Q8_0|tiny:Q4_0|smollm2:Q4_1|
        tinyllama|PATH] [--threads 1] [--dtype bfloat16] [--no-pin] [--out bench/results/x.json]

"tiny:KIND" is bench/decode.py's 1.1B model of TinyLlama's shape (random weights, SmolLM2's
vocabulary) as a GGUF of that quantization, so both sides load the same file. By default each
worker (our stage nodes, llama.cpp's RPC servers) is pinned to its own core with taskset (one
core per "machine"), and both leaders (our bench process, llama-bench) run unpinned.
"tinyllama" is the same shape as float16 safetensors (ours only: llama.cpp cannot load it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from meshllm.cluster.gossip import fetch_view
from meshllm.cluster.placement import Plan, StageAssignment
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions, leader_for_plan, wait_for_fleet
from meshllm.pipeline.events import LeaderObserver
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.tls import PLAINTEXT

AIDREAMS = Path(__file__).resolve().parents[2] / "shared" / "models" / "aidreams-260k"
TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000)


def tinyllama_folder(cache: Path) -> Path:
    folder = cache / "tinyllama-1.1b-shape-random"
    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    c = TINYLLAMA
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **c, "head_dim": 64,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16"}
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * 64

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).half()

    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], h), "lm_head.weight": w(c["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=torch.float16)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        tensors |= {f"{p}.self_attn.q_proj.weight": w(h, h), f"{p}.self_attn.k_proj.weight": w(kv, h),
                    f"{p}.self_attn.v_proj.weight": w(kv, h), f"{p}.self_attn.o_proj.weight": w(h, h),
                    f"{p}.mlp.gate_proj.weight": w(i, h), f"{p}.mlp.up_proj.weight": w(i, h),
                    f"{p}.mlp.down_proj.weight": w(h, i),
                    f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.float16),
                    f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.float16)}
    save_file(tensors, folder / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # any tokenizer with ids < vocab will do
        shutil.copy(AIDREAMS / name, folder / name)
    return folder


class HopTimer(LeaderObserver):
    """Transport time per hop from the stages' timestamps (one machine, one clock)."""

    def __init__(self):
        self.forward_hops: list[float] = []  # leader -> stage 0 -> ... -> last stage
        self.return_path: list[float] = []  # last stage -> (relayed) -> leader
        self.lock = threading.Lock()

    def on_step(self, batch, result, seconds: float) -> None:
        if not result.ok or not result.timings:
            return
        now = time.time()
        t = sorted(result.timings, key=lambda x: x.stage_index)
        hops = [t[0].received_at - (now - seconds)] + [b.received_at - a.sent_at for a, b in zip(t, t[1:])]
        with self.lock:
            self.forward_hops += hops
            self.return_path.append(now - t[-1].sent_at)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)
    return {"p50_ms": 1e3 * values[len(values) // 2], "p95_ms": 1e3 * values[int(len(values) * 0.95)],
            "n": len(values)}


def run_stages(cluster: LocalCluster, channels, files, num_stages: int, options: ServingOptions,
               new_tokens: int) -> dict:
    n = files.config.num_hidden_layers
    bounds = [round(k * n / num_stages) for k in range(num_stages + 1)]
    stages = tuple(StageAssignment(cluster.node_ids[k], cluster.addresses[k], bounds[k], bounds[k + 1], 0, 0, 0)
                   for k in range(num_stages))
    plan = Plan(files.model_id, files.source.fingerprint(), n, options.context_length, options.max_batch, 2, 2,
                stages, 0.0, False)
    timer = HopTimer()
    leader = leader_for_plan(files, plan, channels, options, observer=timer)
    prompt = files.tokenizer.encode("The history of distributed computing begins with")[:32]
    try:
        list(leader.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))  # warm-up
        timer.forward_hops.clear(), timer.return_path.clear()
        out = {"decode_tok_s_batch1": decode_rate(leader, prompt, 1, new_tokens)}
        out["hops"] = {"forward": percentiles(timer.forward_hops), "return_path": percentiles(timer.return_path)}
        for concurrency in (4, 16):
            out[f"aggregate_tok_s_{concurrency}"] = decode_rate(leader, prompt, concurrency, new_tokens)
    finally:
        leader.close()
    return out


def decode_rate(leader, prompt: list[int], concurrency: int, new_tokens: int) -> float:
    """Generated tokens per second over all sequences, prefill excluded (timed from each first token)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    spans = []

    def one(i: int) -> None:
        first = last = None
        count = 0
        for e in leader.generate(prompt[:-1] + [prompt[-1] + i], params):
            if e.token_id is None:
                continue
            now = time.perf_counter()
            first = first or now
            last = now
            count += 1
        spans.append((first, last, count - 1))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = min(s[0] for s in spans)
    end = max(s[1] for s in spans)
    return sum(s[2] for s in spans) / (end - start)


def pin_nodes(cluster: LocalCluster, cores: list[int]) -> dict[str, int]:
    """Every thread of node i onto cores[i % len(cores)] (threads started later inherit it)."""
    pinned = {}
    for i, process in enumerate(cluster.processes):
        core = cores[i % len(cores)]
        subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(process.pid)], check=True,
                       capture_output=True)
        pinned[cluster.node_ids[i]] = core
    return pinned


def llama_cpp_rpc(path: Path, threads: int, cores: list[int | None], new_tokens: int) -> dict:
    """llama.cpp on the same file: RPC mode over two servers, and one process (no split)."""
    import llama_cpp

    with llama_cpp.rpc_servers(cores[:2], threads) as servers:
        two = llama_cpp.rpc_bench(path, [address for address, _ in servers], new_tokens, threads=threads)
        two["server_peak_rss_mib"] = [llama_cpp.peak_rss_mib(pid) for _, pid in servers]  # each held its half
    one = llama_cpp.local_bench(path, threads, new_tokens, core=cores[0])
    return {"rpc_2_servers": two, "one_process": one, "server_cores": cores[:2], "threads_per_server": threads}


def model_path(name: str, cache: Path) -> Path | None:
    if name == "tinyllama":
        return tinyllama_folder(cache)
    if name == "smollm2":
        return None
    if ":" in name:
        import decode

        return decode.model_path(name)
    return Path(name)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny:BF16")
    parser.add_argument("--threads", type=int, default=1, help="threads per stage process (and per RPC server)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--int8", action="store_true", help="weight-only int8 linears on every stage")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--no-pin", action="store_true", help="leave workers on any core")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "meshllm-bench")
    parser.add_argument("--insecure-plaintext", action="store_true",
                        help="nodes and leader without TLS, to measure what TLS costs the data plane")
    args = parser.parse_args()
    path = model_path(args.model, args.cache)
    files = open_model(path)
    stage_counts = [int(s) for s in args.stages.split(",")]
    cores = sorted(os.sched_getaffinity(0))
    options = ServingOptions(context_length=512, max_batch=16, dtype=args.dtype,
                             quantization="int8" if args.int8 else None,
                             scheduler=SchedulerConfig(max_batched_tokens=512, prefill_chunk=256))
    results = {"model": files.model_id, "file": str(files.path), "tls": not args.insecure_plaintext,
               "dtype": args.dtype, "int8": args.int8, "threads_per_stage": args.threads,
               "new_tokens": args.new_tokens, "cpu_count": len(cores), "stages": {}}
    with tempfile.TemporaryDirectory() as state:
        tls = PLAINTEXT if args.insecure_plaintext else None
        cluster = LocalCluster(max(stage_counts), [files.path], Path(state), threads_per_node=args.threads,
                               extra_args=("--insecure-plaintext",) if tls is PLAINTEXT else ())
        cluster.start()
        try:
            key = load_key(cluster.key_file)
            wait_for_fleet(lambda: fetch_view(cluster.addresses[0], key, tls=tls), files.source.fingerprint(),
                           cluster.num_nodes, timeout_s=300)
            if not args.no_pin:
                results["node_cores"] = pin_nodes(cluster, cores)
            channels = ChannelPool(ChannelConfig("bench", key, tls))
            for count in stage_counts:
                results["stages"][str(count)] = run_stages(cluster, channels, files, count, options,
                                                           args.new_tokens)
                print(json.dumps({count: results["stages"][str(count)]}), file=sys.stderr, flush=True)
        finally:
            cluster.stop()
    one = results["stages"].get("1", {}).get("decode_tok_s_batch1")
    two = results["stages"].get("2", {}).get("decode_tok_s_batch1")
    if one and two:
        results["two_stage_vs_one"] = round(two / one, 3)
    if not args.skip_llama_cpp and files.path.suffix == ".gguf":
        theirs = results["llama_cpp"] = llama_cpp_rpc(files.path, args.threads,
                                                      [None, None] if args.no_pin else cores, args.new_tokens)
        if two:
            results["two_stage_vs_llama_cpp_rpc"] = round(two / theirs["rpc_2_servers"]["decode_tok_s"], 3)
        if one:
            results["one_stage_vs_llama_cpp_one_process"] = round(one / theirs["one_process"]["decode_tok_s"], 3)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
