"""The headline speculative benchmark: two machines faster than one for a model that fits on one.

"Machine" A runs the leader and the whole target model (the verifier); machine B runs a
`meshllm node --draft-model DRAFT` that drafts for it over gRPC. Each is confined to its own
core (taskset) and its own network namespace; the two namespaces are joined by a veth pair,
and every byte to and from the proposer passes a relay on B that delays it `--delay-ms` each
way (tests/pipeline/delay_relay.py: this kernel has no netem), so drafts cross a slow link. The node
listens on B's loopback and advertises B's veth address, where the relay listens. The baseline is machine
A alone on its core decoding plainly; `--local-ngram` adds A alone with n-gram drafts.
Every prompt runs in each mode back to back (interleaved, alternating order); `speedup` is the
ratio of the modes' median tok/s, `speedup_paired_median` the median of each run's ratio to the
one-machine run beside it. Greedy, batch 1; outputs are compared (token-identical unless the default kernels differ in
the last bits between a k+1-row and a one-row pass; the JSON says). Prints one JSON object.

    flock -x /work/cpu.lock python bench/spec_two_machines.py [--model PATH] [--draft PATH]
        [--dtype float32] [--delay-ms 0.5] [--rate 1gbit] [--max-tokens 64] [--repeats 3] [--cores 0 1]

Needs root (network namespaces) and two cores. The default model is the SmolLM2-135M-Instruct
Q4_1 GGUF, verified in float32 and drafted by the same weights in int8 (the node's draft form).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IP_VERIFIER, IP_PROPOSER = "10.231.7.1", "10.231.7.2"
PROPOSER_PORT = 47611


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--draft", default=None, help="draft model for machine B (default: the target's files)")
    parser.add_argument("--draft-quantize", default="int8", choices=["int8", "int4", "none"],
                        help="the draft node's --draft-quantize")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--delay-ms", type=float, default=0.5, help="relay delay each way (RTT gains twice it)")
    parser.add_argument("--rate", default="1gbit", help="tbf rate on each end of the veth")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", default=["free", "repetitive"])
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1])
    parser.add_argument("--local-ngram", action="store_true")
    parser.add_argument("--role", default="driver", choices=["driver", "leader"])
    parser.add_argument("--proposer-address", default=None)
    parser.add_argument("--key-file", default=None)
    args = parser.parse_args()
    if args.role == "leader":
        leader_role(args)
    else:
        driver(args)


def driver(args) -> None:
    """Namespaces, the proposer node on core B, then this script again as the leader on core A."""
    from meshllm.model.source import default_model_path
    from meshllm.transport.auth import generate_key, write_key
    from tests.netns import namespace_pair

    model = args.model or str(default_model_path())
    draft = args.draft or model
    core_a, core_b = args.cores
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as state, namespace_pair(IP_VERIFIER, IP_PROPOSER, rate=args.rate) as ns:
        key_file = Path(state) / "cluster.key"
        write_key(key_file, generate_key())
        on_b = ["ip", "netns", "exec", ns.ns_b, "taskset", "-c", str(core_b), sys.executable]
        node = start(on_b + ["-m", "meshllm.cli", "node", "--host", "127.0.0.1", "--advertise-host", IP_PROPOSER,
                             "--port", str(PROPOSER_PORT), "--key-file", str(key_file), "--node-id", "proposer",
                             "--no-discovery", "--state-dir", str(Path(state) / "node"), "--draft-model", draft,
                             "--draft-quantize", args.draft_quantize],
                     env, "listening on")
        relay = start(on_b + [str(ROOT / "tests" / "pipeline" / "delay_relay.py"), IP_PROPOSER, str(PROPOSER_PORT),
                              "127.0.0.1", str(PROPOSER_PORT), str(args.delay_ms)], env, "relay ready")
        try:
            leader = subprocess.run(
                ["ip", "netns", "exec", ns.ns_a, "taskset", "-c", str(core_a), sys.executable, __file__,
                 "--role", "leader", "--proposer-address", f"{IP_PROPOSER}:{PROPOSER_PORT}", "--key-file",
                 str(key_file), "--model", model, "--dtype", args.dtype, "--max-tokens", str(args.max_tokens),
                 "--repeats", str(args.repeats), "--delay-ms", str(args.delay_ms), "--kinds", *args.kinds,
                 *(["--local-ngram"] if args.local_ngram else [])],
                env=env, capture_output=True, text=True, timeout=3000)
            try:
                report = json.loads(leader.stdout)
            except json.JSONDecodeError:
                raise SystemExit(f"the leader failed ({leader.returncode}):\n{leader.stderr[-4000:]}") from None
            # Seen here: gRPC's C++ threads abort the leader at interpreter exit after its report.
            report["leader_exit_code"] = leader.returncode
            report["leader_log_tail"] = [line for line in leader.stderr.splitlines()
                                         if "Warning" not in line and "warn(" not in line][-40:]
        finally:
            for process in (relay, node):  # `ip netns exec` and taskset exec: each pid is the python itself
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    report.update(draft=str(draft), draft_quantize=args.draft_quantize, cores={"verifier": core_a, "proposer": core_b})
    print(json.dumps(report, indent=1))


def start(command: list[str], env: dict, ready_mark: str, timeout_s: float = 180.0) -> subprocess.Popen:
    """Start a process in its own session; return once it printed `ready_mark`."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    ready, log = threading.Event(), []

    def follow():
        for line in process.stdout:
            log.append(line.rstrip())
            if ready_mark in line:
                ready.set()
    threading.Thread(target=follow, daemon=True).start()
    if not ready.wait(timeout_s):
        process.kill()
        process.wait()
        raise SystemExit(f"{' '.join(command[5:8])} did not start:\n" + "\n".join(log[-20:]))
    return process


def round_trip_ms(channels, address: str, samples: int = 30) -> float:
    """Median time of a gRPC Health.Check on the proposer: one call's round trip across the link."""
    from meshllm.cluster.gossip import node_id_at

    times = []
    for _ in range(samples + 3):
        started = time.perf_counter()
        node_id_at(channels, address, timeout=5)
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times[3:]), 3)


def leader_role(args) -> None:
    import torch

    from meshllm.cluster.gossip import fetch_view
    from meshllm.engine.sampler import SamplingParams
    from meshllm.engine.scheduler import SchedulerConfig
    from meshllm.model.source import open_model
    from meshllm.pipeline.cluster import ServingOptions, local_leader
    from meshllm.spec.factory import SpeculativeChoice, build_proposer
    from meshllm.spec.ngram import NgramProposer
    from meshllm.transport.auth import load_key
    from meshllm.transport.channels import ChannelConfig, ChannelPool
    from speculative import PROMPTS, Counts, chat_ids, run

    import logging
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s %(message)s")
    torch.set_num_threads(1)
    files = open_model(args.model)
    key = load_key(Path(args.key_file))
    options = ServingOptions(context_length=1024, max_batch=1, dtype=args.dtype,
                             scheduler=SchedulerConfig(max_batched_tokens=512, prefill_chunk=256))
    channels = ChannelPool(ChannelConfig("bench-leader", key))
    view = lambda: fetch_view(args.proposer_address, key)  # noqa: E731
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    modes = {"one_machine": lambda: None,
             "two_machines": lambda: build_proposer(SpeculativeChoice.parse("remote"), files, fleet_view=view,
                                                    channels=channels)}
    if args.local_ngram:
        modes["one_machine_ngram"] = NgramProposer
    report = {"model": files.model_id, "dtype": args.dtype, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "relay_delay_ms_each_way": args.delay_ms,
              "grpc_round_trip_ms": round_trip_ms(channels, args.proposer_address),
              "results": {}}
    for kind in args.kinds:
        prompts = [chat_ids(files, text) for text in PROMPTS[kind]]
        row, leaders, counts = {}, {}, {}
        rates, decode_rates, outputs = ({mode: [] for mode in modes} for _ in range(3))
        try:
            for mode, make in modes.items():
                counts[mode] = Counts()
                proposer = make()
                if proposer is not None and hasattr(proposer, "placement"):
                    row["proposer"] = f"{proposer.placement.node_id}/{proposer.placement.model_id}"
                leaders[mode] = local_leader(files, options, counts[mode], proposer)
                run(leaders[mode], prompts[:1], replace(params, max_tokens=8))  # warm-up
                counts[mode].__init__()
            # Interleaved: each prompt of each repeat runs in every mode back to back, in alternating
            # order, so this shared machine's drift (its speed moved 20% between the phases of one run
            # when each mode ran all its prompts in a phase of its own) falls on every mode alike.
            order = list(modes)
            for repeat in range(args.repeats):
                for i, p in enumerate(prompts):  # batch 1: one prompt at a time
                    for mode in order if (repeat * len(prompts) + i) % 2 == 0 else order[::-1]:
                        rate, decode_rate, out = run(leaders[mode], [p], params)
                        rates[mode].append(rate)
                        decode_rates[mode].append(decode_rate)
                        outputs[mode].append(out[0])
        finally:
            for leader in leaders.values():
                leader.close()
        for mode in modes:
            c = counts[mode]
            row[mode] = {"tok_s": round(statistics.median(rates[mode]), 2),
                         "tok_s_runs": [round(r, 2) for r in rates[mode]],
                         "decode_tok_s": round(statistics.median(decode_rates[mode]), 2),
                         "acceptance": round(c.accepted / c.drafted, 3) if c.drafted else None,
                         "tokens_per_pass": round((c.passes + c.accepted) / c.passes, 3) if c.passes else None}
        base = row["one_machine"]["tok_s"]
        for mode in modes:
            if mode != "one_machine":
                row[mode]["speedup"] = round(row[mode]["tok_s"] / base, 3)
                # Each run against the one-machine run of the same prompt beside it.
                row[mode]["speedup_paired_median"] = round(statistics.median(
                    a / b for a, b in zip(rates[mode], rates["one_machine"])), 3)
                row[mode]["decode_speedup"] = round(row[mode]["decode_tok_s"] / row["one_machine"]["decode_tok_s"], 3)
                row[mode]["identical"] = outputs[mode] == outputs["one_machine"]
        report["results"][kind] = row
    channels.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
