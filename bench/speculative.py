"""Speculative decoding benchmark: tok/s and acceptance with and without drafts, at batch 1 and 8
concurrent sequences (a closed batch of 8, and 8 in flight with each finished one replaced: 16
requests), on a 1-stage plan (the whole model in this process) and a 2-stage plan (two
`meshllm node` processes on loopback), for repetitive text (editing code, rewriting a JSON
document, answering with quotes from the prompt) and free story text. Prints one JSON object.

    flock -x /work/cpu.lock python bench/speculative.py [--model PATH] [--proposer ngram|draft:PATH]
        [--stages 1 2] [--batch 1 8] [--steady 8] [--max-tokens 96] [--dtype bfloat16] [--threads 1]

Greedy decoding, so with and without drafts the text is the same (in batch-invariant mode exactly;
the JSON says whether it was here). The default model is the SmolLM2-135M-Instruct Q4_1 GGUF.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from meshllm.cluster.gossip import fetch_view
from meshllm.cluster.placement import Plan, StageAssignment
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.model.source import default_model_path, open_model
from meshllm.pipeline.cluster import ServingOptions, local_leader, new_leader, wait_for_fleet
from meshllm.pipeline.deploy import deploy
from meshllm.pipeline.events import LeaderObserver
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.pipeline.transport import RemotePipeline
from meshllm.spec.factory import SpeculativeChoice, build_proposer
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def average_price(items):
    if not items:
        return 0
    return sum(item.price for item in items) / len(items)


def most_expensive(items):
    best = None
    for item in items:
        if best is None or item.price > best.price:
            best = item
    return best
'''
DOC = ('{"name": "Ada Lovelace", "born": 1815, "died": 1852, "fields": ["mathematics", "computing"], '
       '"notes": "wrote the first published algorithm for a machine", "city": "London", '
       '"parents": ["Lord Byron", "Anne Isabella Milbanke"], "known_for": "notes on the Analytical Engine"}')
QUOTE = ("The bridge will close on Monday for repairs to the north span. Traffic will be diverted through "
         "the east tunnel. Cyclists may use the temporary ferry, which runs every twenty minutes from the old "
         "pier. The bridge will reopen on Friday morning, weather permitting.")
# Repetitive: the answer copies most of the prompt back (an edit of code or a document, a quote),
# as assistants do when asked to change one thing and show the result. Generation stops at the
# model's end of turn, so the text after the copy (free text) weighs only as much as it really does.
# Free: stories, nothing to copy from. Both kinds stop at EOS (greedy output, the same with and
# without drafts) or at --max-tokens.
PROMPTS = {
    "repetitive": [
        f"Rename the variable `items` to `products` in this code and print the whole code:\n\n{CODE}",
        f"Rewrite this JSON document with the key \"city\" changed to \"town\"; print the whole document:\n{DOC}",
        f"Repeat the following text exactly, word for word:\n\n{QUOTE}",
    ],
    "free": [
        "Write a short story about a lighthouse keeper who finds a strange bottle on the beach.",
        "Tell a story about a child who learns to fly a kite with her grandfather.",
        "Write a story about a robot that wants to become a gardener.",
    ],
}


class Counts(LeaderObserver):
    def __init__(self):
        self.drafted = self.accepted = self.passes = 0

    def on_verified(self, num_drafted, num_accepted):
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.passes += 1


def chat_ids(files, text: str) -> list[int]:
    tok = files.tokenizer
    if tok.chat_template is None:
        return tok.encode(text)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def run(leader, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, list[list[int]]]:
    """All prompts at once; returns (generated tokens / second from first submit to last token, decode
    tokens / second from the first token to the last, i.e. without the prompts' prefill, ids)."""
    events = [queue.Queue() for _ in prompts]
    started = time.perf_counter()
    for i, p in enumerate(prompts):
        leader.submit(p, params, events[i].put)
    out, first_token_at, last_token_at = [], [], started
    for q in events:
        tokens = []
        while True:
            e = q.get(timeout=600)
            if e.error is not None:
                raise e.error
            if e.token_id is not None:
                tokens.append(e.token_id)
                if len(tokens) == 1:
                    first_token_at.append(time.perf_counter())
                last_token_at = max(last_token_at, time.perf_counter())
            if e.finish_reason is not None:
                break
        out.append(tokens)
    generated = sum(len(t) for t in out)
    decode_s = last_token_at - min(first_token_at, default=last_token_at)
    return generated / (last_token_at - started), (generated - len(out)) / decode_s if decode_s else 0.0, out


def run_groups(leader, groups: list[list[list[int]]], params: SamplingParams) -> tuple[float, float, list[list[int]]]:
    """Each group of prompts at once, one group after another: (end-to-end, decode) tokens / second."""
    tokens = decoded = 0
    seconds = decode_s = 0.0
    out = []
    for group in groups:
        rate, decode_rate, ids = run(leader, group, params)
        n = sum(len(t) for t in ids)
        tokens, decoded = tokens + n, decoded + n - len(ids)
        seconds += n / rate
        decode_s += (n - len(ids)) / decode_rate if decode_rate else 0.0
        out.extend(ids)
    return tokens / seconds, decoded / decode_s if decode_s else 0.0, out


def run_steady(leader, prompts: list[list[int]], concurrency: int, params: SamplingParams
               ) -> tuple[float, float, list[list[int]]]:
    """`concurrency` sequences in flight, the next prompt submitted as soon as one finishes, until
    all are done: what serving 8 concurrent streams does (a closed batch of 8 instead ends at its
    slowest sequence, so a sequence that drafts its way to the end early saves no step). Returns
    (generated tokens / second from first submit to last token, the same, ids in prompt order)."""
    events: queue.Queue = queue.Queue()
    out: list[list[int]] = [[] for _ in prompts]
    started = time.perf_counter()
    submitted = done = 0
    last_token_at = started

    def submit_next() -> None:
        nonlocal submitted
        i = submitted
        leader.submit(prompts[i], params, lambda e, i=i: events.put((i, e)))
        submitted += 1

    for _ in range(min(concurrency, len(prompts))):
        submit_next()
    while done < len(prompts):
        i, e = events.get(timeout=600)
        if e.error is not None:
            raise e.error
        if e.token_id is not None:
            out[i].append(e.token_id)
            last_token_at = time.perf_counter()
        if e.finish_reason is not None:
            done += 1
            if submitted < len(prompts):
                submit_next()
    rate = sum(len(t) for t in out) / (last_token_at - started)
    return rate, rate, out


def measure(make_leader, files, args) -> dict:
    """Both leaders live side by side and their runs alternate (plain, speculative, speculative,
    plain, ...), so drift in what else this shared machine runs hits both alike."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    results = {}
    for kind in args.kinds:
        ids = [chat_ids(files, t) for t in PROMPTS[kind]]
        for batch, steady in [(b, False) for b in args.batch] + [(b, True) for b in args.steady]:
            # Batch 1: every prompt in turn. Batch b: b sequences at once, cycling through the prompts.
            # Steady b: b in flight, 2b requests in all, each finished one replaced at once.
            if steady:
                groups = [[ids[i % len(ids)] for i in range(2 * batch)]]
            else:
                groups = [[p] for p in ids] if batch == 1 else [[ids[i % len(ids)] for i in range(batch)]]
            modes = ("plain", "speculative")
            counts = {m: Counts() for m in modes}
            leaders = {}
            try:
                for m in modes:
                    leaders[m] = make_leader(m == "speculative", counts[m])
                    run(leaders[m], groups[0][:1], replace(params, max_tokens=8))  # warm-up
                    counts[m].__init__()
                rates = {m: [] for m in modes}
                decode_rates = {m: [] for m in modes}
                outputs = {}
                for repeat in range(args.repeats):
                    # ABBA: each mode runs first as often as second, so a drift within a pair
                    # (a cache warmed, a neighbour's load) does not favour one of them.
                    for m in modes if repeat % 2 == 0 else modes[::-1]:
                        if steady:
                            rate, decode_rate, outputs[m] = run_steady(leaders[m], groups[0], batch, params)
                        else:
                            rate, decode_rate, outputs[m] = run_groups(leaders[m], groups, params)
                        rates[m].append(rate)
                        decode_rates[m].append(decode_rate)
            finally:
                for leader in leaders.values():
                    leader.close()
            row = {}
            for m in modes:
                c = counts[m]
                row[m] = {"tok_s": round(statistics.median(rates[m]), 2), "tok_s_runs": [round(r, 2) for r in rates[m]],
                          "decode_tok_s": round(statistics.median(decode_rates[m]), 2),
                          "decode_tok_s_runs": [round(r, 2) for r in decode_rates[m]],
                          "acceptance": round(c.accepted / c.drafted, 3) if c.drafted else None,
                          "tokens_per_pass": round((c.passes + c.accepted) / c.passes, 3) if c.passes else None,
                          "tokens_generated": [len(t) for t in outputs[m]]}
            row["identical"] = outputs["plain"] == outputs["speculative"]
            row["speedup"] = round(row["speculative"]["tok_s"] / row["plain"]["tok_s"], 3)
            # Per pair of neighbouring runs (in either order): how noisy the ratio is.
            row["speedup_runs"] = [round(s / p, 3) for p, s in zip(rates["plain"], rates["speculative"])]
            # Without the prompts' prefill (the same work in both modes): what drafting changes.
            row["decode_speedup"] = round(row["speculative"]["decode_tok_s"] / row["plain"]["decode_tok_s"], 3)
            row["decode_speedup_runs"] = [round(s / p, 3) for p, s in zip(decode_rates["plain"],
                                                                         decode_rates["speculative"])]
            results[f"{kind}/{'steady' if steady else 'batch'}{batch}"] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--proposer", default="ngram")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steady", type=int, nargs="*", default=[8],
                        help="also these many sequences in flight, each finished one replaced at once")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens (default: stop at EOS)")
    parser.add_argument("--kinds", nargs="+", default=list(PROMPTS))
    parser.add_argument("--repeats", type=int, default=4, help="runs of each mode, in ABBA order (default 4: even, "
                        "so each mode runs first as often as second)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    files = open_model(path)
    # No prefix cache: in the default (fast) kernels a prompt's tail computed after a cache hit takes
    # other kernel paths than the same rows inside a whole-prompt chunk, so its logits differ in the
    # last bits; a batch of 8 repeats 3 prompts, and whether a copy hits the cache depends on when
    # its twin's prefill committed. Outputs then differed between two plain runs (3 of 8 free-text
    # sequences, from their 8th-19th token), which made "identical" compare cache timing, not drafts.
    options = ServingOptions(context_length=1024, max_batch=8, dtype=args.dtype, batch_invariant=args.batch_invariant,
                             scheduler=SchedulerConfig(max_batched_tokens=512, prefill_chunk=256, prefix_cache_blocks=0))
    choice = SpeculativeChoice.parse(args.proposer)
    report = {"model": files.model_id, "proposer": args.proposer, "dtype": args.dtype,
              "batch_invariant": args.batch_invariant, "threads": args.threads, "max_tokens": args.max_tokens,
              "ignore_eos": args.ignore_eos,
              "repeats": args.repeats, "results": {}}
    if 1 in args.stages:
        def local(spec, counts):
            return local_leader(files, options, counts, build_proposer(choice, files) if spec else None)
        report["results"]["1-stage"] = measure(local, files, args)
    if 2 in args.stages:
        with tempfile.TemporaryDirectory() as state, \
                LocalCluster(2, [files.path], Path(state), extra_args=("--gossip-interval", "0.3"),
                             threads_per_node=args.threads) as cluster:
            key = load_key(cluster.key_file)
            wait_for_fleet(lambda: fetch_view(cluster.addresses[0], key), files.source.fingerprint(), 2)
            channels = ChannelPool(ChannelConfig("bench-leader", key))
            n = files.config.num_hidden_layers
            stages = (StageAssignment("node-0", cluster.addresses[0], 0, n // 2, 0, 0, 0),
                      StageAssignment("node-1", cluster.addresses[1], n // 2, n, 0, 0, 0))
            plan = Plan(files.model_id, files.source.fingerprint(), n, options.context_length, options.max_batch,
                        2, 2, stages, 0.0, False)
            plan_id = deploy(plan, channels, options.dtype, options.batch_invariant)

            def remote(spec, counts):
                transport = RemotePipeline(channels.get(stages[0].address, stages[0].node_id), plan_id, 2)
                return new_leader(files, transport, options, counts, build_proposer(choice, files) if spec else None)
            report["results"]["2-stage"] = measure(remote, files, args)
            channels.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
