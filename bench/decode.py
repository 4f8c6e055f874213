"""Decode and prefill speed and resident memory against llama.cpp, same GGUF files, same threads.

Rows: SmolLM2-135M-Instruct Q4_1 (the demo GGUF as shipped), BF16 and Q8_0 (made from it by
llama-quantize), and a 1.1B model of TinyLlama's shape (random weights, SmolLM2's 49152-token
vocabulary so the file carries a real tokenizer) in BF16, Q8_0 and Q4_0; on request ("moe:Q4_K",
not in the default rows) a mixture of experts laid out as Qwen3-30B-A3B, smaller (MOE), and
("oss:MXFP4_MOE") one laid out as gpt-oss-20b, smaller (GPT_OSS: experts MXFP4, the rest Q8_0,
as llama.cpp's MXFP4_MOE writes them), and ("glm:Q4_K") one laid out as GLM-4.5-Air, smaller (GLM).
For each: our decode
tok/s at batch 1 and 8 (64 new tokens after a 32-token prompt), prefill tok/s (512 tokens, one
chunk), steady and peak RSS, and the decode step split into graph building (Python) and ggml
compute; llama.cpp's llama-bench (tg64, pp512) and llama-batched-bench (8 sequences) on the same
file with the same thread count, and its peak RSS. Each of our rows runs in a fresh process, in
`--dtype auto` (what `meshllm serve` runs); rounds alternate us and llama.cpp (--rounds, medians).
Rows "smollm2:dense-float32|float16|bfloat16" load the shipped GGUF dequantized to that dtype (the form
a safetensors model takes): what the default --dtype is chosen by (engine/dtypes.py).
Prints one JSON object. llama.cpp is built on first use (bench/llama_cpp.py, ~15 min).

    flock -x /work/cpu.lock python bench/decode.py [--threads 2] [--rows smollm2:Q4_1,tiny:Q4_0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT, NEW, PREFILL, BATCH = 32, 64, 512, 8
ROWS = ["smollm2:Q4_1", "smollm2:BF16", "smollm2:Q8_0", "tiny:BF16", "tiny:Q8_0", "tiny:Q4_0"]
TINYLLAMA = dict(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, head_dim=64)
# Qwen3-30B-A3B's layout (experts of 4 in every layer, q/k norms) at a size this machine runs: 950M
# parameters, 142M of them active a token (Qwen3-30B-A3B: 30.5B, 3.3B active, 128 experts, 8 a token)
MOE = dict(hidden=1024, intermediate=512, layers=16, heads=16, kv_heads=4, head_dim=64, experts=32,
           experts_per_token=4)
# gpt-oss-20b's layout (32 experts, 4 a token, as wide as the model; 64-dim heads, more query dims
# than hidden ones; every other layer windowed to 128; sinks and biases) at a size this machine runs:
# 830M parameters, 120M active a token (gpt-oss-20b: 21B, 3.6B active, hidden 2880, 24 layers)
GPT_OSS = dict(hidden=1024, intermediate=1024, layers=8, heads=32, kv_heads=4, head_dim=64, experts=32,
               experts_per_token=4, gpt_oss=True)
# GLM-4.5-Air's layout (a dense first layer, then experts picked by sigmoid scores plus a bias, with
# a shared expert; q/k/v biases; half of each head turned) at a size this machine runs: 1.0B
# parameters, 150M active a token (GLM-4.5-Air: 106B, 12B active, 128 experts, 8 a token, 46 layers)
GLM = dict(hidden=1024, intermediate=512, dense_intermediate=2816, layers=16, heads=16, kv_heads=4, head_dim=64,
           experts=32, experts_per_token=4, glm=True)


def model_path(row: str) -> Path:
    import llama_cpp

    from meshllm.model.source import default_model_path

    name, kind = row.split(":")
    if kind.startswith("dense-"):
        return default_model_path() if name == "smollm2" else model_path(f"{name}:BF16")
    if name == "smollm2":
        shipped = default_model_path()
        return shipped if kind == "Q4_1" else llama_cpp.make_variant(shipped, kind)
    shape, stem = {"moe": (MOE, "qwen3moe"), "oss": (GPT_OSS, "gpt-oss"), "glm": (GLM, "glm4moe")}.get(
        name, (TINYLLAMA, "tinyllama"))
    base = llama_cpp.CACHE / "bench" / f"{stem}-shape-random.BF16.gguf"
    if not base.exists():
        base.parent.mkdir(parents=True, exist_ok=True)  # a fresh machine has no bench cache yet
        write_random_llama(default_model_path(), base, shape)
    return base if kind == "BF16" else llama_cpp.make_variant(base, kind)


def write_random_llama(tokenizer_gguf: Path, out: Path, t: dict) -> None:
    """A model of shape `t` (TINYLLAMA: TinyLlama-1.1B's; MOE: a Qwen3-MoE's, smaller) with random
    bf16 weights (std 0.02) and SmolLM2's tokenizer."""
    import numpy as np
    import torch
    from gguf import GGUFWriter
    from gguf.constants import ExpertGatingFuncType, GGMLQuantizationType as GGML, RopeScalingType

    from meshllm.model.gguf import GGUFFile
    from tests.quantized_gguf import copy_tokenizer

    meta = GGUFFile.open(tokenizer_gguf).metadata
    experts, oss, glm = t.get("experts", 0), t.get("gpt_oss", False), t.get("glm", False)
    arch = "gpt-oss" if oss else "glm4moe" if glm else "qwen3moe" if experts else "llama"
    w = GGUFWriter(out.with_suffix(".tmp"), arch)
    for add, value in ((w.add_block_count, t["layers"]), (w.add_context_length, 2048),
                       (w.add_embedding_length, t["hidden"]),
                       (w.add_feed_forward_length, t.get("dense_intermediate", t["intermediate"])),
                       (w.add_head_count, t["heads"]), (w.add_head_count_kv, t["kv_heads"]),
                       (w.add_rope_dimension_count, t["head_dim"] // 2 if glm else t["head_dim"]),
                       (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_rope_freq_base, 10000.0)):
        add(value)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(t["experts_per_token"])
        w.add_expert_feed_forward_length(t["intermediate"])
    if glm:  # as conversion/glm.py writes GLM-4.5-Air's
        w.add_expert_shared_count(1)
        w.add_leading_dense_block_count(1)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(True)
    if oss:  # as conversion/gpt_oss.py writes gpt-oss-20b's: a 128 window, YaRN over 4096 positions
        w.add_key_length(t["head_dim"])
        w.add_value_length(t["head_dim"])
        w.add_sliding_window(128)
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    copy_tokenizer(meta, w)
    g = torch.Generator().manual_seed(0)
    vocab = len(meta["tokenizer.ggml.tokens"])

    def bf16(rows: int, cols: int):
        x = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
        return x.view(torch.int16).numpy().view(np.uint8).reshape(rows, cols * 2)

    def add(name: str, rows: int, cols: int, stacked: int = 0) -> None:
        shape = (stacked, rows, cols * 2) if stacked else (rows, cols * 2)  # stacked: [experts, rows, cols]
        w.add_tensor(name, bf16(max(stacked, 1) * rows, cols).reshape(shape), raw_shape=shape, raw_dtype=GGML.BF16)

    h, i, q, kv = t["hidden"], t["intermediate"], t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"]
    add("token_embd.weight", vocab, h)
    add("output.weight", vocab, h)
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for b in range(t["layers"]):
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            add(f"blk.{b}.{name}.weight", rows, cols)
        sparse = experts and not (glm and b == 0)  # GLM's first layer is dense
        width = i if sparse or not glm else t["dense_intermediate"]
        for name, rows, cols in (("gate", width, h), ("up", width, h), ("down", h, width)):
            add(f"blk.{b}.ffn_{name}{'_exps' if sparse else ''}.weight", rows, cols, experts if sparse else 0)
        if sparse:  # the router
            w.add_tensor(f"blk.{b}.ffn_gate_inp.weight", (torch.randn(experts, h, generator=g) * 0.02).numpy())
        if glm:  # q/k/v biases; a sparse layer's shared expert and the bias that picks its experts
            for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                w.add_tensor(f"blk.{b}.{name}.bias", (torch.randn(rows, generator=g) * 0.02).numpy())
            if sparse:
                for name, rows, cols in (("gate", i, h), ("up", i, h), ("down", h, i)):
                    add(f"blk.{b}.ffn_{name}_shexp.weight", rows, cols)
                w.add_tensor(f"blk.{b}.exp_probs_b.bias", (torch.randn(experts, generator=g) * 0.02).numpy())
        if experts and not oss and not glm:  # Qwen3's q/k norms
            for norm in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{b}.{norm}.weight", np.ones(t["head_dim"], dtype=np.float32))
        if oss:  # biases everywhere, the sinks; the MLP's norm is named post_attention_norm
            small = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).numpy()  # noqa: E731
            for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv), ("attn_output", h),
                               ("ffn_gate_inp", experts)):
                w.add_tensor(f"blk.{b}.{name}.bias", small(rows))
            for name, rows in (("gate", i), ("up", i), ("down", h)):
                w.add_tensor(f"blk.{b}.ffn_{name}_exps.bias", small(experts, rows))
            w.add_tensor(f"blk.{b}.attn_sinks.weight", small(t["heads"]))
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(f"blk.{b}.{'post_attention_norm' if oss or glm else 'ffn_norm'}.weight",
                     np.ones(h, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out.with_suffix(".tmp").rename(out)


def ours(path: Path, threads: int, dense: str | None = None, own_ops: bool = True) -> dict:
    """Our figures for one GGUF, in this (fresh) process; `dense`: dequantized to that dtype;
    `own_ops=False`: ggml's kernels only (meshllm's few-row products off; what they buy)."""
    import llama_cpp
    import psutil
    import torch

    torch.set_num_threads(threads)
    from meshllm.engine.host_memory import return_large_frees
    from meshllm.engine.stage_weights import load_stage_decoder
    from meshllm.model.source import open_model

    from meshllm.engine.dtypes import DEFAULT_DTYPE, DTYPES

    return_large_frees()  # as every meshllm command does
    if not own_ops:
        from meshllm.engine import ggml_stage

        ggml_stage.FEW_ROWS_MAX = ggml_stage.QUANT_FEW_ROWS_MAX = 0
        ggml_stage.ALL_ROWS_OPS = frozenset()
        ggml_stage.q8_0x8_ops = lambda: None  # the Q8_0 head re-laid out for meshllm's op
        ggml_stage.attention_op = ggml_stage.batched_attention_ops = lambda: None
    files = open_model(path, tokenizer=False)  # as a stage opens it (stage_control._open_files)
    dtype = DTYPES[DEFAULT_DTYPE]  # what `meshllm serve` runs with: --dtype auto
    t = time.perf_counter()
    if dense:
        decoder = load_dense(files, getattr(torch, dense))
    else:
        decoder = load_stage_decoder(files.source, files.config, dtype=dtype)
    load_s = time.perf_counter() - t
    del files
    figures = speeds(decoder)
    figures.update(load_s=round(load_s, 1),
                   steady_rss_mib=round(psutil.Process().memory_info().rss / 2**20, 1),
                   # VmHWM, not ru_maxrss: that starts from the parent's RSS at fork (this bench's,
                   # just after writing a 2 GB model file: 3071 MiB reported for a 1.1 GB stage)
                   peak_rss_mib=llama_cpp.peak_rss_mib(os.getpid()),
                   fast_path=decoder.fast_path is not None)
    return figures


def speeds(decoder, sync=lambda: None, warm_batch: bool = False) -> dict:
    """Decode tok/s at batch 1 (median of 3, after a warm-up) and BATCH, prefill tok/s (best of 2),
    and the batch-1 step's split into graph building and ggml compute where ggml runs it. `sync`
    waits for a device's queued work (torch.cuda.synchronize on a GPU) before a clock is read;
    `warm_batch`: a warm-up at BATCH too (a GPU's first batched step compiles or records)."""
    import torch

    from meshllm.engine.kv_cache import SequenceKV
    from meshllm.model.decoder import SeqSlice

    vocab = decoder.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def decode(batch: int) -> tuple[float, list[float], list[float]]:
        kvs = [SequenceKV(decoder.kv_layout(), PROMPT + NEW + 1) for _ in range(batch)]
        for kv in kvs:
            decoder(torch.randint(3, vocab, (PROMPT,), generator=g), torch.arange(PROMPT), [SeqSlice(kv, 0, PROMPT)],
                    torch.tensor([PROMPT - 1]))
        tokens = torch.randint(3, vocab, (batch,), generator=g)
        build, compute = [], []
        sync()
        started = time.perf_counter()
        for _ in range(NEW):
            slices = [SeqSlice(kv, i, 1) for i, kv in enumerate(kvs)]
            logits = decoder(tokens, torch.tensor([kv.length for kv in kvs]), slices, torch.arange(batch))
            tokens = logits.argmax(dim=-1)
            if hasattr(decoder.fast_path, "last_build_s"):  # ggml's whole-stage path
                build.append(decoder.fast_path.last_build_s)
                compute.append(decoder.fast_path.last_compute_s)
        sync()
        return batch * NEW / (time.perf_counter() - started), build, compute

    decode(1)  # warm-up, as llama-bench does: first-use costs (graph caches, a GPU's kernels) stay out
    runs = [decode(1) for _ in range(3)]
    best = max(runs, key=lambda r: r[0])
    prefill = []
    for _ in range(2):
        kv = SequenceKV(decoder.kv_layout(), PREFILL)
        ids = torch.randint(3, vocab, (PREFILL,), generator=g)
        sync()
        t = time.perf_counter()
        decoder(ids, torch.arange(PREFILL), [SeqSlice(kv, 0, PREFILL)], torch.tensor([PREFILL - 1]))
        sync()
        prefill.append(PREFILL / (time.perf_counter() - t))
    if warm_batch:
        decode(BATCH)
    figures = {"decode_tok_s": round(statistics.median(r[0] for r in runs), 2),
               "decode_tok_s_runs": [round(r[0], 2) for r in runs],
               "decode_batch8_tok_s": round(decode(BATCH)[0], 2), "prefill_tok_s": round(max(prefill), 1)}
    if best[1]:
        figures["decode_step_ms"] = {"graph_build": round(statistics.median(best[1]) * 1000, 2),
                                     "ggml_compute": round(statistics.median(best[2]) * 1000, 2),
                                     "total": round(1000 / best[0], 2)}
    return figures


def load_dense(files, dtype):
    """The GGUF dequantized to `dtype` at load, then given the forms load_stage_decoder gives a
    safetensors model of that dtype (ggml's whole-layer graph over the dense weights)."""
    from meshllm.engine import ggml_stage
    from meshllm.engine.ggml_lib import runtime
    from meshllm.model.loader import load_decoder

    decoder = load_decoder(files.source, files.config, dtype=dtype)
    if runtime() is not None and ggml_stage.supports(decoder) is None:
        decoder.fast_path = ggml_stage.GGMLStage(runtime(), decoder)
    return decoder


def median_figures(rounds: list[dict]) -> dict:
    """Each numeric figure's median over the rounds; the rest as in the last round."""
    out = dict(rounds[-1])
    for key, value in rounds[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = round(statistics.median(r[key] for r in rounds), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="threads for us and llama.cpp (default 2)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated (default: {','.join(ROWS)})")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="only our figures")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of us and llama.cpp (default 3)")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # internal: our figures for one file
    parser.add_argument("--dense", help=argparse.SUPPRESS)  # internal: with --one, dequantized to this dtype
    parser.add_argument("--ggml-ops-only", action="store_true",
                        help="our rows with ggml's kernels only: meshllm's few-row products (bf16, Q4_0/Q4_1, Q8_0, "
                             "Q4_K/Q5_K/Q6_K, the Q8_0 head's layout) off, and K-quant few-row steps on ggml's own "
                             "choice of kernel")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(ours(args.one, args.threads, args.dense, own_ops=not args.ggml_ops_only)))
        return
    import llama_cpp

    out: dict = {"meshllm_few_row_ops": not args.ggml_ops_only, "threads": args.threads, "prompt_tokens": PROMPT,
                 "new_tokens": NEW, "prefill_tokens": PREFILL, "rows": {}}
    for row in args.rows.split(","):
        path = model_path(row)
        result: dict = {"file": str(path), "file_mib": round(path.stat().st_size / 2**20, 1)}
        kind = row.split(":")[1]
        dense = ["--dense", kind.removeprefix("dense-")] if kind.startswith("dense-") else []
        compare = not args.skip_llama_cpp and not dense
        # Rounds alternate us and llama.cpp, so a load that comes and goes on a shared machine
        # weighs on both sides alike; each side's figure is its median over the rounds.
        ours_rounds, theirs_rounds = [], []
        for _ in range(args.rounds):
            done = subprocess.run([sys.executable, __file__, "--one", str(path), "--threads", str(args.threads),
                                   *dense, *(["--ggml-ops-only"] if args.ggml_ops_only else [])],
                                  check=True, capture_output=True, text=True)
            ours_rounds.append(json.loads(done.stdout.strip().splitlines()[-1]))
            if compare:
                theirs_rounds.append(llama_cpp.bench(path, args.threads, PREFILL, NEW))
        mine = result["ours"] = median_figures(ours_rounds)
        result["ours_rounds"] = ours_rounds
        if compare:
            theirs = result["llama_cpp"] = median_figures(theirs_rounds)
            result["llama_cpp_rounds"] = theirs_rounds
            if llama_cpp.NO_AMX:
                result["llama_cpp_build"] = "native without AMX (its AMX matmul segfaults on this CPU)"
            result["ratio"] = {k: round(mine[k] / theirs[k], 2) for k in
                               ("decode_tok_s", "decode_batch8_tok_s", "prefill_tok_s") if theirs.get(k)}
            result["ratio"]["rss_steady_vs_llama_cpp_peak"] = round(mine["steady_rss_mib"] / theirs["peak_rss_mib"], 2)
            result["ratio_by_round"] = {k: [round(a[k] / b[k], 2) for a, b in zip(ours_rounds, theirs_rounds)]
                                        for k in ("decode_tok_s", "decode_batch8_tok_s", "prefill_tok_s")
                                        if all(b.get(k) for b in theirs_rounds)}
        out["rows"][row] = result
        print(json.dumps({row: result}), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
