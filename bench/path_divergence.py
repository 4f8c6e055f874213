"""How far apart the default kernels' two ways of computing a prompt's positions land: rows of a
prefill chunk (ggml's GEMM and flash attention) against the same rows as decode steps (meshllm's
few-row kernels), and each against a float32 reference (the batch-invariant torch path over the
dequantized weights).

A prefix-cache hit computes a prompt's tail as decode-sized rows, and a failover rebuilds every
running sequence's KV by prefilling its committed tokens, which decode steps first computed. In
`--batch-invariant` mode both ways give the same bits; in the default mode they differ by what
8-bit activation blocks and a bf16 KV cache round differently, which this measures: per prompt,
the largest logit difference over the vocabulary at the last position and the change in the
reference's top token's logprob, with the last k positions computed as one-row steps. Prints JSON.

    flock -x /work/cpu.lock python bench/path_divergence.py [--model PATH] [--tails 1 8 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshllm.engine.dtypes import DEFAULT_DTYPE, DTYPES  # noqa: E402
from meshllm.engine.kv_cache import SequenceKV  # noqa: E402
from meshllm.engine.stage_weights import load_stage_decoder  # noqa: E402
from meshllm.model.decoder import SeqSlice  # noqa: E402
from meshllm.model.source import default_model_path, open_model  # noqa: E402

PROMPTS = ("Explain how a bicycle works, in detail, step by step.", "Write a story about a dragon who learns to read.",
           "What is the capital of France and why is it famous?", "List three uses of copper in modern electronics.",
           "Rewrite this sentence in the passive voice: the cat chased the mouse.", "Why is the sky blue?")


def last_logits(decoder, ids: list[int], as_steps: int) -> torch.Tensor:
    """Logits at the last position: the first len(ids) - as_steps positions as one prefill chunk,
    the rest one row per step."""
    kv = SequenceKV(decoder.kv_layout(), len(ids) + 8)
    head = len(ids) - as_steps
    out = decoder(torch.tensor(ids[:head]), torch.arange(head), [SeqSlice(kv, 0, head)], torch.tensor([head - 1]))
    for p in range(head, len(ids)):
        out = decoder(torch.tensor([ids[p]]), torch.tensor([p]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
    return out[0].float()


def gap(a: torch.Tensor, b: torch.Tensor, top: int) -> dict:
    return {"max_abs_logit": round(float((a - b).abs().max()), 4),
            "top_logprob": round(float(torch.log_softmax(a, -1)[top] - torch.log_softmax(b, -1)[top]), 4),
            "same_argmax": int(a.argmax()) == int(b.argmax())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--tails", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    files = open_model(args.model or default_model_path())
    fast = load_stage_decoder(files.source, files.config, dtype=DTYPES[DEFAULT_DTYPE])
    reference = load_stage_decoder(files.source, files.config, dtype=torch.float32, batch_invariant=True)
    tok = files.tokenizer
    rows = []
    for text in PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        ref = last_logits(reference, ids, 0)
        top = int(ref.argmax())
        prefill = last_logits(fast, ids, 0)
        row = {"tokens": len(ids), "prefill_vs_reference": gap(prefill, ref, top)}
        for k in args.tails:
            steps = last_logits(fast, ids, k)
            row[f"last_{k}_as_steps"] = {"vs_prefill": gap(steps, prefill, top), "vs_reference": gap(steps, ref, top)}
        rows.append(row)

    def median(path: list[str], field: str) -> float:
        values = []
        for r in rows:
            node = r
            for key in path:
                node = node[key]
            values.append(abs(node[field]))
        return round(statistics.median(values), 4)

    summary = {"prefill_vs_reference": {f: median(["prefill_vs_reference"], f) for f in ("max_abs_logit", "top_logprob")}}
    for k in args.tails:
        for other in ("vs_prefill", "vs_reference"):
            summary[f"last_{k}_as_steps_{other}"] = {f: median([f"last_{k}_as_steps", other], f)
                                                    for f in ("max_abs_logit", "top_logprob")}
    print(json.dumps({"model": files.model_id, "dtype": DEFAULT_DTYPE, "fast_path": fast.fast_path is not None,
                      "threads": args.threads, "median_abs": summary, "prompts": rows}, indent=1))


if __name__ == "__main__":
    main()
