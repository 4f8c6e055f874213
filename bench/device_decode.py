"""Decode and prefill speed and memory of a GGUF on a GPU (`--device cuda`), beside transformers.

Rows, each on the same GPU in this one process:
- ours, blocks: the GGUF as `meshllm serve --device cuda` loads it (engine/device_weights.py):
  block-quantized weights stay the file's bytes on the device (Q8_0/Q4_0/Q4_1 split into planes,
  engine/block_planes.py); products of up to 16 rows run a fused Triton kernel
  (engine/triton_blocks.py), larger ones dequantize by torch ops inside each product; decode
  steps replay as CUDA graphs (engine/cuda_graphs.py); activations and KV in --dtype.
  The same with one part changed back at a time: "_no_graphs" (every step's kernels launched
  from Python), "_torch_path" (no fused kernel: every product dequantizes by torch ops).
- ours, dense: the same file dequantized to --dtype at load (what a safetensors model is), with
  and without CUDA graphs.
- transformers: its own model of the same GGUF (it dequantizes the blocks at load) in --dtype,
  decoding with its DynamicCache in the same loop (no generate() overhead): the reference on
  this machine. llama.cpp's CUDA build is not made here: it takes longer than the 15 minutes of
  GPU time a session is lent.

Figures per row as bench/decode.py's (decode batch 1 / 8, prefill 512), plus the GPU memory the
weights take and the peak while running, CUDA kernels launched per batch-1 decode step, and how
many of 32 greedy tokens after a real prompt ours and transformers agree on (a prefix length).
"matrix_products": one product with Llama-8B-sized matrices in each fused type: the fused
kernel, the torch path and a dense bf16 matrix (microseconds, replayed as a CUDA graph; GB/s of
the bytes read).

    python bench/device_decode.py [--model PATH] [--device cuda] [--dtype bfloat16]

`--device cpu` runs the same rows on the CPU (a check of this script where no GPU is lent).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import BATCH, NEW, PREFILL, PROMPT, speeds  # noqa: E402

AGREE_TOKENS = 32
PROMPT_TEXT = "The capital of France is"


def on_cuda(device) -> bool:
    return device.type == "cuda"


def synchronizer(device):
    import torch

    return (lambda: torch.cuda.synchronize(device)) if on_cuda(device) else (lambda: None)


def gpu_memory(device) -> tuple:
    import torch

    if not on_cuda(device):
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def reset_peak(device) -> None:
    import torch

    if on_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def kernels_per_step(step, device) -> int | None:
    """CUDA kernels one call of `step` launches (torch's profiler, one warm call)."""
    from torch.profiler import ProfilerActivity, profile

    if not on_cuda(device):
        return None
    step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def ours(files, dtype, device, dense: bool) -> tuple[dict, list[int]]:
    import torch

    from meshllm.engine.cuda_graphs import graphed
    from meshllm.engine.kv_cache import SequenceKV
    from meshllm.engine.stage_weights import decoder_bytes, load_stage_decoder
    from meshllm.model.decoder import SeqSlice
    from meshllm.model.loader import load_decoder

    reset_peak(device)
    sync = synchronizer(device)
    t = time.perf_counter()
    if dense:
        decoder = graphed(load_decoder(files.source, files.config, dtype=dtype).to(device))
    else:
        decoder = load_stage_decoder(files.source, files.config, dtype=dtype, device=str(device))
    sync()
    load_s = time.perf_counter() - t
    weights = gpu_memory(device)[0]
    figures = speeds(decoder, sync=sync, warm_batch=on_cuda(device))
    kv = SequenceKV(decoder.kv_layout(), 8)

    def step():
        decoder(torch.tensor([5]), torch.tensor([kv.length]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
        sync()

    figures.update(load_s=round(load_s, 1), weights_bytes_counted=decoder_bytes(decoder),
                   gpu_weights_mib=round(weights / 2**20, 1),
                   gpu_peak_mib=round(gpu_memory(device)[1] / 2**20, 1),
                   kernels_per_decode_step=kernels_per_step(step, device))
    if hasattr(decoder.fast_path, "recorded"):
        figures["cuda_graphs"] = {"recorded": decoder.fast_path.recorded, "replays": decoder.fast_path.replays,
                                  "enabled": decoder.fast_path.enabled}
    ids = files.tokenizer.encode(PROMPT_TEXT)
    kv = SequenceKV(decoder.kv_layout(), len(ids) + AGREE_TOKENS)
    logits = decoder(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(kv, 0, len(ids))],
                     torch.tensor([len(ids) - 1]))
    greedy = []
    for _ in range(AGREE_TOKENS):
        greedy.append(int(logits.argmax(dim=-1)[0]))
        logits = decoder(torch.tensor(greedy[-1:]), torch.tensor([kv.length]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
    return figures, greedy  # the decoder goes with this frame: main() empties the cache


def transformers_row(path: Path, dtype, device) -> tuple[dict, list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    reset_peak(device)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).to(device).eval()
    sync = synchronizer(device)
    sync()
    load_s = time.perf_counter() - t
    weights = gpu_memory(device)[0]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)

    @torch.inference_mode()
    def decode(batch: int) -> float:
        ids = torch.randint(3, vocab, (batch, PROMPT), generator=g).to(device)
        out = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        started = time.perf_counter()
        for _ in range(NEW):
            out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        return batch * NEW / (time.perf_counter() - started)

    @torch.inference_mode()
    def prefill() -> float:
        ids = torch.randint(3, vocab, (1, PREFILL), generator=g).to(device)
        sync()
        t = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync()
        return PREFILL / (time.perf_counter() - t)

    decode(1)  # warm-up, as for ours
    runs = [decode(1) for _ in range(3)]
    cache = {}

    @torch.inference_mode()
    def step():
        if "past" not in cache:
            cache["past"] = model(input_ids=torch.tensor([[5]], device=device), past_key_values=DynamicCache(),
                                  use_cache=True).past_key_values
        model(input_ids=torch.tensor([[5]], device=device), past_key_values=cache["past"], use_cache=True)
        sync()

    figures = {"decode_tok_s": round(statistics.median(runs), 2), "decode_tok_s_runs": [round(r, 2) for r in runs],
               "decode_batch8_tok_s": round(decode(BATCH), 2), "prefill_tok_s": round(max(prefill(), prefill()), 1),
               "load_s": round(load_s, 1), "gpu_weights_mib": round(weights / 2**20, 1),
               "gpu_peak_mib": round(gpu_memory(device)[1] / 2**20, 1),
               "kernels_per_decode_step": kernels_per_step(step, device)}
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with torch.inference_mode():
        ids = torch.tensor([tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)], device=device)
        out = model.generate(ids, max_new_tokens=AGREE_TOKENS, do_sample=False, min_new_tokens=AGREE_TOKENS)
    return figures, out[0, ids.shape[1]:].tolist()


def graph_replay_us(fn, device) -> float:
    """Microseconds a call, of 20 calls replayed as one CUDA graph: the kernels' time, as
    decode runs them (timed as launched from Python, a Triton kernel of ~10 us measured
    70-200 us on an H200: the launches', bench/results/device-decode-h200-families.json).
    bench/fused_blocks_ab.py times its kernels so too."""
    import torch

    side = torch.cuda.Stream(device)  # warmed on a side stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):  # compiles and tunes, outside the recording
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 20 * 1000


def matrix_products(device) -> dict:
    """One product of 1 and 8 rows with Llama-8B-sized matrices (4096x4096, 14336x4096) held as
    GGUF blocks: the fused kernel, the torch path (dequantize, then F.linear) and a dense bf16
    F.linear, in microseconds and in GB/s of the bytes each must read (blocks, or the dense
    matrix). Random bytes are valid blocks once their f16 scales are set (small, positive)."""
    import torch
    from gguf.constants import GGML_QUANT_SIZES

    from meshllm.engine import block_planes, triton_blocks
    from meshllm.engine.block_dequant import dequantize

    if not triton_blocks.available(device):
        return {"skipped": "no Triton on this device"}
    import torch.nn.functional as F

    out = {}
    for n, k in ((4096, 4096), (14336, 4096)):
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        for ggml_type in sorted(triton_blocks.TYPES, key=lambda t: t.value):
            block, size = GGML_QUANT_SIZES[ggml_type]
            blocks = torch.randint(0, 256, (n, k // block * size), device=device, dtype=torch.uint8)
            scales = blocks.view(n, k // block, size)
            scales[:, :, :2] = torch.tensor([0x1F, 0x21], dtype=torch.uint8, device=device)  # f16 ~0.0104
            if ggml_type.name == "Q4_1":
                scales[:, :, 2:4] = torch.tensor([0x1F, 0xA1], dtype=torch.uint8, device=device)  # m ~ -0.0104
            planes = block_planes.split(blocks, ggml_type)
            for rows in (1, 8):
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                y = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
                want = F.linear(x.float(), dequantize(blocks, ggml_type, k, torch.bfloat16).float())
                fused = graph_replay_us(lambda: triton_blocks.rows_times_planes(x, planes, ggml_type, y), device)
                error = ((y.float() - want).abs().max() / want.abs().max()).item()
                torch_path = graph_replay_us(
                    lambda: F.linear(x, dequantize(blocks, ggml_type, k, torch.bfloat16)), device)
                dense_us = graph_replay_us(lambda: F.linear(x, dense), device)
                out[f"{n}x{k} {ggml_type.name} rows={rows}"] = {
                    "fused_us": round(fused, 1), "torch_path_us": round(torch_path, 1),
                    "dense_bf16_us": round(dense_us, 1), "fused_gb_s": round(blocks.numel() / fused / 1e3, 1),
                    "dense_bf16_gb_s": round(dense.numel() * 2 / dense_us / 1e3, 1),
                    "fused_max_error_rel": float(f"{error:.2g}")}
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the demo's SmolLM2 Q4_1)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", help="activations, KV and dense weights (default bfloat16)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--products-only", action="store_true", help="only the matrix products (no model needed)")
    parser.add_argument("--quick", action="store_true",
                        help="blocks and dense only: not the rows with one part changed back, nor the products")
    args = parser.parse_args()
    import torch

    from meshllm.engine.dtypes import torch_dtype
    from meshllm.model.source import default_model_path, open_model

    device = torch.device(args.device)
    if on_cuda(device) and not torch.cuda.is_available():
        sys.exit(f"{args.device}: this torch ({torch.__version__}) has no CUDA device")
    if args.products_only:
        print(json.dumps({"device": torch.cuda.get_device_name(device) if on_cuda(device) else "cpu",
                          "torch": torch.__version__, "matrix_products": matrix_products(device)}, indent=1))
        return
    dtype = torch_dtype(args.dtype)
    path = args.model or default_model_path()
    files = open_model(path)
    name = torch.cuda.get_device_name(device) if on_cuda(device) else "cpu"
    result = {"model": path.name, "device": name, "torch": torch.__version__,
              "dtype": str(dtype).removeprefix("torch."), "prompt": PROMPT, "new_tokens": NEW, "batch": BATCH,
              "prefill": PREFILL}
    from meshllm.engine import cuda_graphs, triton_blocks

    result["fused_kernel"] = triton_blocks.available(device) and triton_blocks.ENABLED
    result["ours_blocks"], greedy_blocks = ours(files, dtype, device, dense=False)
    result["ours_dense"], greedy_dense = ours(files, dtype, device, dense=True)
    greedy_others = {}
    if on_cuda(device) and not args.quick:  # the same with one part changed back at a time
        torch.cuda.empty_cache()
        for name, dense, module, attribute, value in (("no_graphs", False, cuda_graphs, "ENABLED", False),
                                                      ("torch_path", False, triton_blocks, "ENABLED", False),
                                                      ("dense_no_graphs", True, cuda_graphs, "ENABLED", False)):
            kept = getattr(module, attribute)
            setattr(module, attribute, value)
            try:
                row = f"ours_{name}" if dense else f"ours_blocks_{name}"
                result[row], greedy_others[name] = ours(files, dtype, device, dense=dense)
            finally:
                setattr(module, attribute, kept)
            torch.cuda.empty_cache()
    result["greedy_agree"] = {"blocks_vs_dense": common_prefix(greedy_blocks, greedy_dense), "of": AGREE_TOKENS}
    for name, greedy in greedy_others.items():
        result["greedy_agree"][f"blocks_vs_{name}"] = common_prefix(greedy_blocks, greedy)
    if result["fused_kernel"] and not args.quick:
        result["matrix_products"] = matrix_products(device)
    if not args.skip_transformers:
        result["transformers"], greedy_hf = transformers_row(path, dtype, device)
        result["greedy_agree"]["blocks_vs_transformers"] = common_prefix(greedy_blocks, greedy_hf)
        result["ratio_blocks_to_transformers"] = {
            key: round(result["ours_blocks"][key] / result["transformers"][key], 2)
            for key in ("decode_tok_s", "decode_batch8_tok_s", "prefill_tok_s")}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
