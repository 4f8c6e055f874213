"""Tensor-parallel decode on loopback against one process, and the planner's prediction of its cost.

Runs, on a random-weight Llama-shaped model (hidden 2048, 32 heads, 4 KV heads, MLP 5632:
TinyLlama-1.1B's layers, --layers of them):
- one process pinned to one core, 1 thread (what one TP rank's core could do alone = TP=1);
- one process pinned to two cores, 2 threads (the best two cores can do in one process);
- TP=2: two processes (gloo on loopback), one thread each, pinned to cores 0 and 1.
Each decodes --tokens tokens at batch 1 after a 32-token prompt; tok/s is from the median
step. Rank 0 also reports the time inside its collectives per token (all-reduces, the step
command's broadcast, the logits' gather) and per all-reduce, and the link measured between
the two ranks with the planner's own probe (tp/link_probe.py), from which the planner's
cost model (cluster/tp_cost.py) predicts the per-token collective time. Prints one JSON object.

    flock -x /work/cpu.lock python bench/tensor_parallel.py [--layers 8] [--dtype bfloat16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from meshllm.cluster.card import Card, LinkProbe, NodeId  # noqa: E402
from meshllm.cluster.placement import PlacementRequest  # noqa: E402
from meshllm.cluster.stage_budget import Footprint  # noqa: E402
from meshllm.cluster.tp_cost import estimate  # noqa: E402
from meshllm.engine.kv_cache import SeqId  # noqa: E402
from meshllm.engine.sampler import SamplingParams  # noqa: E402
from meshllm.engine.stage_runner import StageRunner  # noqa: E402
from meshllm.engine.step import SeqWork, Step  # noqa: E402
from meshllm.engine.weight_forms import prepare_for_cpu  # noqa: E402
from meshllm.model.config import ModelConfig  # noqa: E402
from meshllm.model.loader import load_decoder  # noqa: E402
from meshllm.model.weights import SafetensorsSource  # noqa: E402
from meshllm.tp.channel import CommandChannel  # noqa: E402
from meshllm.tp.group import GroupSpec, StoreHost, join_group  # noqa: E402
from meshllm.tp.link_probe import SCHEDULE, SMALL_INDICES, run_schedule, summarize  # noqa: E402
from meshllm.tp.load import load_rank_decoder  # noqa: E402
from meshllm.tp.runner import TensorParallelRunner  # noqa: E402
from meshllm.tp.shard import ShardLayout  # noqa: E402
from meshllm.tp.worker import TensorParallelWorker  # noqa: E402

PROMPT_TOKENS, WARMUP_STEPS = 32, 4
GREEDY = SamplingParams(temperature=0.0, seed=1)


def model_config(num_layers: int) -> dict:
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=2048,
                intermediate_size=5632, num_hidden_layers=num_layers, num_attention_heads=32,
                num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
                tie_word_embeddings=False, hidden_act="silu")


def build_model(folder: Path, num_layers: int) -> None:
    """Random bf16 weights at unit-ish scale under the Hugging Face names."""
    c = model_config(num_layers)
    h, i, q, kv = c["hidden_size"], c["intermediate_size"], 32 * 64, 4 * 64
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], h), "lm_head.weight": w(c["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for n in range(num_layers):
        p = f"model.layers.{n}"
        tensors |= {f"{p}.self_attn.q_proj.weight": w(q, h), f"{p}.self_attn.k_proj.weight": w(kv, h),
                    f"{p}.self_attn.v_proj.weight": w(kv, h), f"{p}.self_attn.o_proj.weight": w(h, q),
                    f"{p}.mlp.gate_proj.weight": w(i, h), f"{p}.mlp.up_proj.weight": w(i, h),
                    f"{p}.mlp.down_proj.weight": w(h, i),
                    f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                    f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(c))


def decode_seconds(runner, num_tokens: int, on_measuring=lambda: None) -> list[float]:
    """Seconds of each decode step (batch 1) after the prompt and a few warm-up steps;
    `on_measuring` runs just before the first measured step."""
    ids = torch.arange(1, PROMPT_TOKENS + 1, dtype=torch.int64)
    times, position = [], 0
    for step_id in range(1 + WARMUP_STEPS + num_tokens):
        step = Step(step_id, (SeqWork(SeqId(1), position, ids.numel(), 1, GREEDY),), ids)
        if step_id == 1 + WARMUP_STEPS:
            on_measuring()
        started = time.perf_counter()
        [token] = runner.run(step)
        if step_id > WARMUP_STEPS:
            times.append(time.perf_counter() - started)
        position += ids.numel()
        ids = torch.tensor([token.token_id])
    return times


def run_single(args) -> dict:
    torch.set_num_threads(args.threads)
    source = SafetensorsSource(args.model)
    decoder = load_decoder(source, source.config(), dtype=getattr(torch, args.dtype))
    prepare_for_cpu(decoder, None, False)
    times = decode_seconds(StageRunner(decoder), args.tokens)
    return {"threads": args.threads, "step_s_median": statistics.median(times),
            "tok_s": 1 / statistics.median(times)}


def run_rank(args) -> dict | None:
    torch.set_num_threads(1)
    source = SafetensorsSource(args.model)
    config = source.config()
    collective = join_group(GroupSpec("bench", args.rank, 2, args.store, "127.0.0.1", timeout_s=60))
    decoder = load_rank_decoder(source, config, ShardLayout.of(config, args.rank, 2), collective,
                                dtype=getattr(torch, args.dtype))
    # The planner's link probe, between these two pinned processes, over this very group.
    probe_times = run_schedule(collective, SCHEDULE, SMALL_INDICES if args.rank == 0 else range(0))
    runner = StageRunner(decoder, samples=args.rank == 0)
    channel = CommandChannel(collective)
    if args.rank != 0:
        worker = TensorParallelWorker(runner, channel)
        worker.start()
        worker.join()
        return None
    link = summarize(NodeId("rank-1"), SCHEDULE, probe_times)
    tp = TensorParallelRunner(runner, channel)
    marks = []
    times = decode_seconds(tp, args.tokens, lambda: marks.append(_stats(collective)))
    before, after = marks[0], _stats(collective)
    tp.close()
    n = len(times)
    spent = {k: (after[k] - before[k]) for k in after}
    predicted = _prediction(config, link, args)
    per_all_reduce = spent["all_reduce_s"] / spent["num_all_reduce"]
    return {
        "step_s_median": statistics.median(times), "tok_s": 1 / statistics.median(times),
        "link_probe": {"latency_us": link.latency_s * 1e6, "bandwidth_gbps": link.bandwidth_gbps},
        "measured_per_token": {
            "collective_ms": spent["seconds"] / n * 1e3, "all_reduce_ms": spent["all_reduce_s"] / n * 1e3,
            "broadcast_ms": spent["broadcast_s"] / n * 1e3, "gather_ms": spent["gather_s"] / n * 1e3,
            "num_all_reduce": spent["num_all_reduce"] / n, "per_all_reduce_us": per_all_reduce * 1e6,
            "per_layer_us": 2 * per_all_reduce * 1e6},
        "predicted_per_token": {
            "collective_ms": predicted.collective_s * 1e3, "num_collectives": predicted.num_collectives,
            "per_all_reduce_us": predicted.link.all_reduce_s(predicted.message_bytes, 2) * 1e6},
        "prediction_error": predicted.collective_s / (spent["seconds"] / n) - 1,
    }


def _stats(collective) -> dict:
    s = collective.stats
    return {"seconds": s.seconds, "all_reduce_s": s.all_reduce_s, "num_all_reduce": s.num_all_reduce,
            "broadcast_s": s.broadcast_s, "gather_s": s.gather_s}


def _prediction(config: ModelConfig, link: LinkProbe, args):
    """What the planner predicts for this group: the same cost model, the same measured link."""
    request = PlacementRequest(model_id="bench", fingerprint="-", config=config, context_length=PROMPT_TOKENS
                               + WARMUP_STEPS + args.tokens, max_batch=1, tensor_parallel=2,
                               weight_dtype_bytes=getattr(torch, args.dtype).itemsize)
    cards = [Card(NodeId(f"rank-{r}"), "127.0.0.1:1", "", "cpu", 1, 1, 10.0, 0.0,
                  links=(LinkProbe(NodeId("rank-1"), link.latency_s, link.bandwidth_gbps),) if r == 0 else ())
             for r in range(2)]
    return estimate(config, Footprint.of(request), cards, [10.0, 10.0], 0, 1, config.num_hidden_layers, 1,
                    request.context_length, request.weight_dtype_bytes)


def group_formation_ms(repeats: int = 10) -> dict:
    """Forming and closing a 2-rank group (both ranks as threads here): what each Load of a
    group and each link probe pays for its own process group, built straight from the store."""
    store = StoreHost("127.0.0.1")
    store.start()
    formed, closed = [], []
    with ThreadPoolExecutor(2) as pool:
        for i in range(repeats):
            specs = [GroupSpec(f"formation-{i}", r, 2, store.endpoint, "127.0.0.1") for r in (0, 1)]
            started = time.perf_counter()
            collectives = list(pool.map(lambda s: join_group(s, store if s.rank == 0 else None), specs))
            formed.append(time.perf_counter() - started)
            started = time.perf_counter()
            for c in collectives:
                c.close()
            closed.append(time.perf_counter() - started)
    store.stop()
    return {"form_ms_median": 1e3 * statistics.median(formed), "close_ms_median": 1e3 * statistics.median(closed)}


def _child(args, role: list[str], cores: str, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = ["taskset", "-c", cores, sys.executable, __file__, "--model", str(args.model), "--dtype", args.dtype,
               "--tokens", str(args.tokens), *role]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)


def _result(process: subprocess.Popen) -> dict:
    out, _ = process.communicate(timeout=900)
    if process.returncode:
        raise SystemExit(f"benchmark child failed ({process.returncode}): {process.args}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration; medians reported")
    parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=("single", "rank"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "single":
        print(json.dumps(run_single(args)))
        return
    if args.role == "rank":
        result = run_rank(args)
        if result is not None:
            print(json.dumps(result))
        return
    formation = group_formation_ms()
    with tempfile.TemporaryDirectory() as tmp:
        args.model = Path(tmp)
        build_model(args.model, args.layers)
        runs: dict[str, list[dict]] = {"one_process_1_thread": [], "one_process_2_threads": [], "tp2": []}
        for _ in range(args.repeats):
            runs["one_process_1_thread"].append(_result(_child(args, ["--role", "single", "--threads", "1"], "0", 1)))
            runs["one_process_2_threads"].append(_result(_child(args, ["--role", "single", "--threads", "2"],
                                                                "0,1", 2)))
            store = StoreHost("127.0.0.1")
            store.start()
            ranks = [_child(args, ["--role", "rank", "--rank", str(r), "--store", store.endpoint], str(r), 1)
                     for r in (0, 1)]
            runs["tp2"].append(_result(ranks[0]))
            ranks[1].wait(timeout=60)
            store.stop()
    print(json.dumps(_summary(args, runs) | {"group_formation": formation}, indent=1))


def _summary(args, runs: dict[str, list[dict]]) -> dict:
    def med(rows, *path):
        values = []
        for row in rows:
            for key in path:
                row = row[key]
            values.append(row)
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    one, two, tp = runs["one_process_1_thread"], runs["one_process_2_threads"], runs["tp2"]
    return {
        "model": {"layers": args.layers, "hidden": 2048, "heads": 32, "kv_heads": 4, "mlp": 5632,
                  "dtype": args.dtype, "batch": 1, "new_tokens": args.tokens, "repeats": args.repeats},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "backend": "gloo on loopback",
                    "gpu": "none: NCCL paths untested"},
        "tok_s": {"one_process_1_thread": med(one, "tok_s"), "one_process_2_threads": med(two, "tok_s"),
                  "tp2_one_thread_per_rank": med(tp, "tok_s")},
        "tp2_vs_1_thread": statistics.median(t["tok_s"] for t in tp) / statistics.median(o["tok_s"] for o in one),
        "tp2_vs_2_threads": statistics.median(t["tok_s"] for t in tp) / statistics.median(o["tok_s"] for o in two),
        "link_probe": {k: med(tp, "link_probe", k) for k in ("latency_us", "bandwidth_gbps")},
        "measured_per_token": {k: med(tp, "measured_per_token", k) for k in tp[0]["measured_per_token"]},
        "predicted_per_token": {k: med(tp, "predicted_per_token", k) for k in tp[0]["predicted_per_token"]},
        "prediction_error": med(tp, "prediction_error"),
        # The planner's whole-step prediction: each rank's half of the measured one-thread step (the
        # compute the cards' measured bandwidth stands for) plus the predicted collectives, per run.
        "step_prediction": _step_prediction(one, tp),
        # What the split costs beyond halving one thread's step: TP=2's step minus half of TP=1's.
        "overhead_per_token_ms": 1e3 * (statistics.median(t["step_s_median"] for t in tp)
                                        - statistics.median(o["step_s_median"] for o in one) / 2),
    }


def _step_prediction(one: list[dict], tp: list[dict]) -> dict:
    half_step_ms = 1e3 * statistics.median(o["step_s_median"] for o in one) / 2
    predicted = [half_step_ms + t["predicted_per_token"]["collective_ms"] for t in tp]
    measured = [1e3 * t["step_s_median"] for t in tp]
    errors = [p / m - 1 for p, m in zip(predicted, measured)]
    return {"predicted_step_ms": statistics.median(predicted), "measured_step_ms": statistics.median(measured),
            "error": {"median": statistics.median(errors), "min": min(errors), "max": max(errors)}}


if __name__ == "__main__":
    main()
