"""`meshllm demo`: a whole meshllm cluster on this machine, serving a real model.

Starts N `meshllm node` processes on loopback, plans the model across all of
them, serves the OpenAI-compatible API from this process, asks it one chat
question, prints the answer and how to ask more, then serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal as signals
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from meshllm.api.app import create_app
from meshllm.api.cluster_backend import local_cluster_backend
from meshllm.api.config import API_KEY_ENV, MIB, APIConfig, add_api_guard_arguments, api_key_from
from meshllm.api.server import APIServer, listen
from meshllm.engine.dtypes import add_dtype_argument
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.engine.stage_weights import QUANTIZE_TYPES
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions
from meshllm.commands.threads import add_threads_argument
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.spec.factory import SPECULATIVE_HELP, SpeculativeChoice

MODEL_ENV = "MESHLLM_MODEL"
SAMPLE_QUESTION = "What is the capital of France? Answer in one sentence."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=3, help="node processes to start (default 3)")
    parser.add_argument("--model", default=None,
                        help=f"HF model folder, .gguf file or hub id (default: ${MODEL_ENV}, else the "
                             f"SmolLM2-135M-Instruct GGUF installed with meshllm)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP API port on 127.0.0.1 (default 8000)")
    add_dtype_argument(parser)
    parser.add_argument("--quantize", choices=sorted(QUANTIZE_TYPES), default=None,
                        help="quantize a 16/32-bit model's linear weights at load: int8 (ggml Q8_0 blocks), int4 (Q4_0); "
                             "GGUF files stay in their own quantization without it (default: none)")
    parser.add_argument("--max-context", type=int, default=2048, help="tokens per request (default 2048)")
    parser.add_argument("--once", action="store_true", help="exit after the sample completion")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="nodes per stage: N > 1 makes each stage a tensor-parallel group of N nodes (gloo "
                             "on loopback), so --nodes / N stages (default 1: a pipeline of --nodes stages)")
    add_api_guard_arguments(parser)
    parser.add_argument("--speculative", default=None, metavar="ngram|draft:MODEL|remote[:NODE]",
                        help=SPECULATIVE_HELP + " (default: off)")
    add_threads_argument(parser, default="the cores shared out among the nodes, at least one each")


def serving_options(args: argparse.Namespace) -> ServingOptions:
    """How the demo serves: a GGUF keeps its own quantization (ggml holds the blocks)."""
    return ServingOptions(context_length=args.max_context, max_batch=16, num_stages=args.nodes // args.tp,
                          dtype=args.dtype, quantization=args.quantize, scheduler=SchedulerConfig(),
                          speculative=args.speculative, tensor_parallel=args.tp)


def run(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.tp < 1 or args.nodes % args.tp:
        raise SystemExit(f"meshllm demo: --nodes ({args.nodes}) must be a positive multiple of --tp ({args.tp})")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"meshllm demo: --port must be in [0, 65535], got {args.port}")
    try:
        api = APIConfig(host="127.0.0.1", port=args.port, api_key=api_key_from(args.api_key),
                        max_body_bytes=int(args.max_body_mib * MIB), chat_template_kwargs=args.chat_template_kwargs)
    except ValueError as e:
        raise SystemExit(f"meshllm demo: {e}") from None
    sock = listen(api.host, api.port, "--port")  # before any node starts: a taken port fails at once
    if args.speculative is not None:
        SpeculativeChoice.parse(args.speculative)
    files = open_model(args.model or os.environ.get(MODEL_ENV) or None)
    print(f"meshllm demo: model {files.model_id} ({files.config.num_hidden_layers} layers) from {files.path}",
          flush=True)
    state_dir = Path(tempfile.mkdtemp(prefix="meshllm-demo-"))
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"meshllm demo: --threads must be at least 1, got {args.threads}")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nodes)  # per node
    collective = ("--collective-port", "0") if args.tp > 1 else ()
    cluster = LocalCluster(args.nodes, [files.path], state_dir, extra_args=("--gossip-interval", "0.5", *collective),
                           threads_per_node=threads, on_exit=_report_exit)
    print(f"meshllm demo: starting {args.nodes} nodes on loopback ...", flush=True)
    started = time.perf_counter()
    cluster.start()
    backend = server = None
    try:
        options = serving_options(args)
        backend, owner, _ = local_cluster_backend(cluster, files, options, "demo-leader")
        plan = owner.plan
        if plan is None:
            raise SystemExit(f"meshllm demo: {backend.health.report().reason}")
        for i, s in enumerate(plan.stages):
            group = f" (tensor-parallel with {', '.join(w.node_id for w in s.workers)})" if s.workers else ""
            print(f"  stage {i}: {s.node_id} at {s.address}{group} holds layers {s.first_layer}-{s.last_layer - 1}",
                  flush=True)
        server = APIServer(create_app(backend, api), api.host, api.port, sock)
        server.start()
        print(f"meshllm demo: cluster ready in {time.perf_counter() - started:.1f}s; API at {server.url}/v1",
              flush=True)
        _ask(server.url, files.model_id, api.api_key)
        _print_next_steps(server.url, files.model_id, api.api_key is not None)
        if not args.once:
            _wait_for_ctrl_c()
    finally:
        if backend is not None:  # before the server: open streams end with an error event (serve.py)
            backend.close()
        if server is not None:
            server.stop()
        cluster.stop()
        shutil.rmtree(state_dir, ignore_errors=True)  # the demo's throwaway key and node state
    return 0


def _report_exit(index: int, returncode: int) -> None:
    how = (f"killed by {signals.Signals(-returncode).name}" if returncode < 0 else f"exit status {returncode}")
    print(f"meshllm demo: node-{index} died ({how}); the leader fails over to the other nodes "
          f"(see /health and /v1/cluster)", flush=True)


def _ask(url: str, model_id: str, api_key: str | None) -> None:
    body = {"model": model_id, "messages": [{"role": "user", "content": SAMPLE_QUESTION}],
            "max_tokens": 48, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.load(response)
    seconds = time.perf_counter() - started
    usage = reply["usage"]
    print(f"\n> {SAMPLE_QUESTION}\n{reply['choices'][0]['message']['content'].strip()}\n"
          f"({usage['completion_tokens']} tokens in {seconds:.1f}s, through every node of the pipeline)\n",
          flush=True)


def _print_next_steps(url: str, model_id: str, needs_key: bool) -> None:
    # The key itself is never printed: the lines read it from the environment.
    auth = f" -H \"Authorization: Bearer ${API_KEY_ENV}\"" if needs_key else ""
    key = f"__import__('os').environ['{API_KEY_ENV}']" if needs_key else "'none'"
    print("Try it yourself:\n"
          f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"    -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n"
          f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key={key}); "
          f"print(c.chat.completions.create(model='{model_id}', messages=[{{'role': 'user', 'content': "
          f"'Hello!'}}]).choices[0].message.content)\"\n"
          f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key={key}); "
          f"print(c.responses.create(model='{model_id}', input='Hello!').output_text)\"   # the Responses API\n"
          f"  fleet: {url}/v1/cluster   metrics: {url}/metrics   dashboard: {url}/\n", flush=True)


def _wait_for_ctrl_c() -> None:
    stop = threading.Event()
    for sig in (signals.SIGINT, signals.SIGTERM):
        signals.signal(sig, lambda signum, frame: stop.set())
    print("meshllm demo: serving; press Ctrl-C to stop", flush=True)
    while not stop.wait(0.5):
        pass
