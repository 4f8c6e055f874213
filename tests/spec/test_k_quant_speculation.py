"""On K-quant GGUF models the default kernels (not batch-invariant mode) keep speculative greedy
output token-identical to plain decoding.

Every step of at most 16 rows (decode batches, verify passes, prefill chunks of this size)
multiplies K-quant matrices with per-row arithmetic (engine/kernels/k_quant_few_rows.c), and the
few-row attention is per row too, so a verify pass's rows carry the bits of one-row steps and
drafts can change no token. Steps are capped at 16 rows here: larger prefill chunks take ggml's
GEMMs, whose rows may differ from few-row steps in the last bits (README, "What the default
kernels do not promise"). The drafter is the model itself (its GGUF loaded again): on random
weights an n-gram proposer rarely finds a match, while the model's own one-row steps draft its
greedy continuation, so long verify passes are accepted whole. Tokens alone would rarely show a
last-bit difference (it must meet a near-tie), so each token's logprob and its top-5 are
compared exactly too.
"""

from __future__ import annotations

import queue
from dataclasses import replace

import pytest
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions, local_leader
from meshllm.spec.drafter import SpecConfig
from meshllm.spec.factory import DraftOptions, load_draft_model
from tests.engine import test_k_quant_few_rows as k_quant_few_rows
from tests.quantized_gguf import write_quantized_llama
from tests.spec.conftest import PROMPTS
from tests.spec.test_speculative_identity import Counting

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)

DEFAULT_KERNELS = ServingOptions(context_length=128, max_batch=8, dtype="bfloat16",
                                 scheduler=SchedulerConfig(max_batched_tokens=16, prefill_chunk=16,
                                                           prefix_block_size=16))


rt = k_quant_few_rows.rt  # the fixture: ggml with both K-quant ops, or a skip saying which is missing


def _scored(files, prompts, options, proposer=None, observer=None) -> list[list[tuple]]:
    """Every prompt at once; per prompt, each token with its logprob and top-5 (ids, logprobs)."""
    leader = local_leader(files, options, observer=observer, proposer=proposer)
    try:
        events = [queue.Queue() for _ in prompts]
        for p, q in zip(prompts, events):
            leader.submit(p, GREEDY, q.put)
        out = []
        for q in events:
            scored = []
            while True:
                e = q.get(timeout=120)
                assert e.error is None, e.error
                if e.token_id is not None:
                    lp = e.logprobs
                    scored.append((e.token_id, lp.logprob, lp.top_ids, lp.top_logprobs))
                if e.finish_reason is not None:
                    break
            out.append(scored)
        return out
    finally:
        leader.close()


@pytest.mark.parametrize("ggml_type", [GGML.Q4_K, GGML.Q6_K], ids=lambda t: t.name)
def test_drafts_change_no_logprob_on_default_kernels(rt, smollm2_gguf_path, tmp_path, ggml_type):
    path = write_quantized_llama(rt, smollm2_gguf_path, tmp_path / "tiny.gguf", ggml_type, num_layers=2,
                                 head_type=ggml_type)
    files = open_model(path)
    prompts = [files.tokenizer.encode(p) for p in PROMPTS]
    expected = _scored(files, prompts, DEFAULT_KERNELS)
    assert all(len(tokens) == GREEDY.max_tokens for tokens in expected)
    draft, _ = load_draft_model(path, DraftOptions(dtype="bfloat16", quantization=None))
    counts = Counting()
    waiting = replace(DEFAULT_KERNELS, spec=SpecConfig(wait_for_drafts=True))
    assert _scored(files, prompts, waiting, draft, counts) == expected
    assert counts.accepted > 0.5 * counts.drafted > 0  # the model's own drafts: long passes, accepted
    assert counts.passes < len(prompts) * GREEDY.max_tokens  # fewer verifier passes than tokens
