"""Soak: many requests through a 3-stage cluster of `meshllm node` processes serving SmolLM2 over
the HTTP API, with the official `openai` client. Mixed prompt lengths, completions and chat,
streaming and not, some streams cancelled mid-way, `--concurrency` at once. Then a leader in a
process of its own is killed (kill -9) mid-stream. Prints one JSON object:

- requests: ok / cancelled (on purpose) / lost (an error or a wrong answer) / hung (no answer
  within --request-timeout), and the wall time;
- memory: each node's resident memory after warm-up (the caches at their budget: the warm-up goes
  on until every stage's prefix store is full) and after the soak, once the stages hold no KV;
- kill: seconds from kill -9 of the leader process until no stage holds its sequences (Stage.Info).

    python bench/soak.py [--requests 300] [--concurrency 8] [--max-tokens 48] [--threads 1]

The test suite runs a bounded version (tests/api/test_soak.py).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a script: the leader process lives in tests/

from meshllm.api.app import create_app  # noqa: E402
from meshllm.api.cluster_backend import local_cluster_backend  # noqa: E402
from meshllm.api.config import APIConfig  # noqa: E402
from meshllm.api.server import APIServer  # noqa: E402
from meshllm.engine.scheduler import SchedulerConfig  # noqa: E402
from meshllm.model.source import default_model_path, open_model  # noqa: E402
from meshllm.pipeline.cluster import ServingOptions  # noqa: E402
from meshllm.pipeline.local_cluster import LocalCluster  # noqa: E402
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc  # noqa: E402
from tests.pipeline import leader_process  # noqa: E402

WORDS = ("the cluster of small machines serves one model together while each node holds a few layers "
         "and passes hidden states onward over the local network to the next one").split()
MODES = ("completion", "chat", "stream_chat", "stream_completion", "cancel")


@dataclass(frozen=True)
class Job:
    mode: str
    prompt: str
    max_tokens: int


def jobs(rng: random.Random, count: int, max_tokens: int) -> list[Job]:
    out = []
    for _ in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 16, 64, 160))))
        out.append(Job(rng.choice(MODES), prompt, rng.choice([t for t in (4, 12, 24, 48) if t <= max_tokens] or [4])))
    return out


def run_job(client: openai.OpenAI, model: str, job: Job, rng: random.Random) -> str:
    """'ok', 'cancelled', 'lost' or 'hung'."""
    try:
        if job.mode == "completion":
            reply = client.completions.create(model=model, prompt=job.prompt, max_tokens=job.max_tokens)
            return "ok" if reply.choices[0].finish_reason in ("stop", "length") else "lost"
        if job.mode == "chat":
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": job.prompt}],
                                                   max_tokens=job.max_tokens)
            return "ok" if reply.choices[0].finish_reason in ("stop", "length") else "lost"
        if job.mode == "stream_completion":
            stream = client.completions.create(model=model, prompt=job.prompt, max_tokens=job.max_tokens,
                                               stream=True)
        else:
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": job.prompt}], max_tokens=job.max_tokens,
                stream=True)
        cancel_after = rng.randint(1, 3) if job.mode == "cancel" else None
        finish, chunks = None, 0
        for chunk in stream:
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                stream.close()  # the client goes away mid-stream
                return "cancelled"
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return "ok" if finish in ("stop", "length") else "lost"
    except openai.APITimeoutError:
        return "hung"
    except openai.APIError:
        return "lost"


def run_jobs(client, model: str, batch: list[Job], concurrency: int, seed: int) -> dict[str, int]:
    counts = {"ok": 0, "cancelled": 0, "lost": 0, "hung": 0}
    lock = threading.Lock()

    def one(i_job):
        i, job = i_job
        outcome = run_job(client, model, job, random.Random(seed + i))
        with lock:
            counts[outcome] += 1

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, enumerate(batch)))
    return counts


def stage_infos(stubs) -> list[stage_pb2.StageInfoReply]:
    return [_info(stub) for stub in stubs]


def _info(stub, attempts: int = 3) -> stage_pb2.StageInfoReply:
    # A connection the server drops (GOAWAY) fails the call in flight; the channel reconnects.
    for attempt in range(attempts):
        try:
            return stub.Info(stage_pb2.StageInfoRequest(), timeout=10)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == attempts - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def held(stubs, plan_id: str | None = None) -> int:
    return sum(len(s.seq_ids) for info in stage_infos(stubs) for s in info.shards if plan_id in (None, s.plan_id))


def wait(predicate, timeout_s: float, interval_s: float = 0.05) -> float:
    """Seconds until `predicate()` held (raises TimeoutError after timeout_s)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"not true within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - started


def rss_mib(cluster: LocalCluster) -> list[float]:
    return [round(psutil.Process(p.pid).memory_info().rss / 2**20, 1) for p in cluster.processes]


def after_kill(client: openai.OpenAI, model: str) -> str:
    """'ok' when the surviving leader still answers a short completion, else what went wrong."""
    try:
        reply = client.completions.create(model=model, prompt="Hello", max_tokens=4)
    except openai.APIError as e:
        return f"{type(e).__name__}: {e}"
    finish = reply.choices[0].finish_reason
    return "ok" if finish in ("stop", "length") else f"finish_reason {finish!r}"


def kill_a_leader_mid_stream(cluster: LocalCluster, model: Path, stubs) -> dict:
    """A leader in its own process streams 2 sequences over the 3 stages; kill -9 it mid-stream."""
    process = leader_process.spawn(model, cluster.key_file, 400, 2, cluster.addresses)
    try:
        line = json.loads(process.stdout.readline())
        plan_id = line["plan_id"]
        held_before = held(stubs, plan_id)
        killed = time.monotonic()
        process.send_signal(signal.SIGKILL)
        wait(lambda: held(stubs, plan_id) == 0, timeout_s=30, interval_s=0.01)
        freed_within_s = time.monotonic() - killed  # an upper bound: polling every 10 ms, 3 Info calls a poll
        process.wait(timeout=10)
        return {"sequences_held_at_kill": held_before, "freed_within_s": round(freed_within_s, 3),
                "left_after": held(stubs, plan_id)}
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens a request asks (4..48)")
    parser.add_argument("--warmup", type=int, default=16, help="warm-up requests at least (more until caches fill)")
    parser.add_argument("--prefix-cache-blocks", type=int, default=64,
                        help="prefix-cache budget (blocks of 32 tokens): the warm-up fills it")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    parser.add_argument("--model", type=Path, default=None, help="default: the SmolLM2-135M-Instruct demo GGUF")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = args.model or default_model_path()
    files = open_model(model)
    rng = random.Random(args.seed)
    options = ServingOptions(context_length=1024, max_batch=args.concurrency, num_stages=3, dtype="bfloat16",
                             scheduler=SchedulerConfig(prefix_cache_blocks=args.prefix_cache_blocks))
    with tempfile.TemporaryDirectory(prefix="meshllm-soak-") as tmp:
        cluster = LocalCluster(3, [files.path], Path(tmp), extra_args=("--gossip-interval", "0.5"),
                               threads_per_node=args.threads)
        cluster.start(timeout_s=180)
        try:
            backend, owner, channels = local_cluster_backend(cluster, files, options, "soak-leader")
            plan = owner.plan
            assert plan is not None and len(plan.stages) == 3, backend.health.report().reason
            server = APIServer(create_app(backend, APIConfig(port=0, request_timeout_s=args.request_timeout)),
                               "127.0.0.1", 0)
            server.start()
            stubs = [stage_pb2_grpc.StageStub(channels.get(a, n)) for a, n in zip(cluster.addresses, cluster.node_ids)]
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                   timeout=args.request_timeout)
            try:
                plan_id = backend.leader.transport.plan_id

                def prefix_full() -> bool:
                    shards = [s for i in stage_infos(stubs) for s in i.shards if s.plan_id == plan_id]
                    return all(s.num_prefix_blocks >= args.prefix_cache_blocks for s in shards)

                warm = {"ok": 0, "cancelled": 0, "lost": 0, "hung": 0}
                for round_ in range(20):  # caches at their budget before the baseline
                    counts = run_jobs(client, backend.model_id, jobs(rng, args.warmup, args.max_tokens),
                                      args.concurrency, 10_000 * (round_ + 1))
                    warm = {k: warm[k] + counts[k] for k in warm}
                    if prefix_full():
                        break
                wait(lambda: held(stubs) == 0, timeout_s=30)
                baseline = rss_mib(cluster)
                started = time.monotonic()
                counts = run_jobs(client, backend.model_id, jobs(rng, args.requests, args.max_tokens),
                                  args.concurrency, 1)
                wall_s = time.monotonic() - started
                drained_s = wait(lambda: held(stubs) == 0, timeout_s=30)
                after = rss_mib(cluster)
                infos = stage_infos(stubs)
                kill = kill_a_leader_mid_stream(cluster, files.path, stubs)
                still_serving = after_kill(client, backend.model_id)
            finally:
                server.stop()
                backend.close()
        finally:
            cluster.stop()
    print(json.dumps({
        "requests": {"total": args.requests, "concurrency": args.concurrency, **counts,
                     "wall_s": round(wall_s, 1), "stages_drained_s": round(drained_s, 3)},
        "warmup": warm,
        "memory": {"baseline_rss_mib": baseline, "after_rss_mib": after,
                   "ratio": [round(a / b, 3) for a, b in zip(after, baseline)],
                   "prefix_blocks": [s.num_prefix_blocks for i in infos for s in i.shards if s.plan_id == plan_id],
                   "prefix_mib": [round(s.prefix_bytes / 2**20, 1) for i in infos for s in i.shards
                                  if s.plan_id == plan_id]},
        "killed_leader": kill,
        "still_serving": still_serving,
    }))


if __name__ == "__main__":
    main()
