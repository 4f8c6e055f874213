"""How often the fast default kernels make speculative greedy output differ from plain greedy output.

In batch-invariant mode a k+1-row verifier pass gives every row the bits of a one-row decode step,
so speculative greedy output is token-identical to plain (the tests assert it). The default
kernels do not promise that: a row's logits may differ in the last bits with the rows beside it,
and where the two likeliest tokens are nearly tied the argmax can flip. This runs each prompt
greedily with and without drafts on the default kernels and reports, per prompt, whether and where
the outputs first differ, and the top-2 logit margin there (logprob differences equal logit
differences), as the plain run saw it and as the speculative run's verifier saw it. Prints JSON.

    flock -x /work/cpu.lock python bench/spec_divergence.py [--model PATH] [--proposer ngram|draft:PATH]
        [--dtype bfloat16] [--max-tokens 64] [--prompts 20]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.model.source import default_model_path, open_model
from meshllm.pipeline.cluster import ServingOptions, local_leader
from meshllm.spec.factory import SpeculativeChoice, build_proposer
from speculative import CODE, DOC, QUOTE, chat_ids

SUBJECTS = ("a lighthouse keeper", "a robot gardener", "a lost kite", "a talking fox", "a baker at dawn",
            "a girl who maps the stars", "an old fisherman", "a city under snow", "a library cat",
            "a train that runs at night", "two friends and a river", "a clockmaker's apprentice")
PROMPTS = (
    [f"Write a short story about {s}." for s in SUBJECTS]
    + [f"Rename the variable `items` to `products` in this code and print the whole code:\n\n{CODE}",
       f"Rewrite this JSON document with the key \"city\" changed to \"town\"; print the whole document:\n{DOC}",
       f"Repeat the following text exactly, word for word:\n\n{QUOTE}",
       "Explain in three sentences why the sky is blue.",
       "List five fruits and one fact about each.",
       "What is the capital of France? Answer, then explain how it became the capital.",
       "Summarise: the meeting moved to Tuesday; Anna brings the slides; the budget is due on Friday.",
       "Write a haiku about autumn, then explain it line by line."]
)


def greedy(leader, prompt: list[int], max_tokens: int) -> tuple[list[int], list]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    tokens, logprobs = [], []
    for event in leader.generate(prompt, params):
        if event.error is not None:
            raise event.error
        if event.token_id is not None:
            tokens.append(event.token_id)
            logprobs.append(event.logprobs)
    return tokens, logprobs


def margin(lp) -> float | None:
    return None if lp is None or len(lp.top_logprobs) < 2 else lp.top_logprobs[0] - lp.top_logprobs[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--proposer", default="ngram")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    files = open_model(args.model or default_model_path())
    options = ServingOptions(context_length=1024, max_batch=1, dtype=args.dtype, batch_invariant=False,
                             scheduler=SchedulerConfig(max_batched_tokens=512, prefill_chunk=256))
    plain = local_leader(files, options)
    spec = local_leader(files, options, proposer=build_proposer(SpeculativeChoice.parse(args.proposer), files))
    rows, all_plain_margins = [], []
    try:
        for text in PROMPTS[:args.prompts]:
            prompt = chat_ids(files, text)
            p_tokens, p_lps = greedy(plain, prompt, args.max_tokens)
            s_tokens, s_lps = greedy(spec, prompt, args.max_tokens)
            all_plain_margins += [m for m in map(margin, p_lps) if m is not None]
            first = next((i for i, (a, b) in enumerate(zip(p_tokens, s_tokens)) if a != b), None)
            row = {"prompt": text[:48], "tokens": len(p_tokens), "diverged_at": first}
            if first is not None:
                row.update(plain_token=p_tokens[first], spec_token=s_tokens[first],
                           plain_top2_margin=round(margin(p_lps[first]), 5),
                           spec_top2_margin=round(margin(s_lps[first]), 5),
                           plain_top2=list(p_lps[first].top_ids), spec_top2=list(s_lps[first].top_ids))
            rows.append(row)
    finally:
        plain.close()
        spec.close()
    diverged = [r for r in rows if r["diverged_at"] is not None]
    margins = [r["plain_top2_margin"] for r in diverged]
    report = {
        "model": files.model_id, "dtype": args.dtype, "batch_invariant": False, "proposer": args.proposer,
        "max_tokens": args.max_tokens, "prompts": len(rows), "diverged": len(diverged),
        "divergence_rate": round(len(diverged) / len(rows), 3),
        "first_divergence_margin_median": round(statistics.median(margins), 5) if margins else None,
        "first_divergence_margin_max": max(margins) if margins else None,
        # For scale: how often any plain step is that close a call at all.
        "plain_steps": len(all_plain_margins),
        "plain_steps_with_margin_below_0.05": sum(m < 0.05 for m in all_plain_margins),
        "plain_steps_with_margin_below_0.25": sum(m < 0.25 for m in all_plain_margins),
        "rows": rows,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
