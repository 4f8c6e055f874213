"""A pipeline computes what one process does, in the default (fast, not batch-invariant) kernels:
hidden states cross a stage boundary in float32, as the ggml graph holds them between layers, so
no boundary rounds anything and greedy output is the single process's token for token wherever
the boundaries fall. (They crossed as bf16 before: 2 of 3 prompts differed from their 17th and
24th token on 2 and 3 stages.) The activations that go on the wire are what is checked here too."""

from __future__ import annotations

import pytest
import torch

from meshllm.engine.dtypes import DEFAULT_DTYPE, DTYPES
from meshllm.engine.kv_cache import SequenceKV
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.decoder import SeqSlice
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions, new_leader
from meshllm.pipeline.transport import LocalPipeline

pytestmark = pytest.mark.timeout(300)
PROMPTS = ("Write a story about a lighthouse keeper.", "Explain how a bicycle works.", "List five fruits.")


def test_stage_boundaries_change_no_greedy_token(smollm2_gguf_path):
    files = open_model(smollm2_gguf_path)
    dtype = DTYPES[DEFAULT_DTYPE]
    decoders = {}

    def run(bounds: list[int]) -> list[list[int]]:
        runners = []
        for first, last in zip(bounds, bounds[1:]):
            key = (first, last)
            decoders.setdefault(key, load_stage_decoder(files.source, files.config, first, last, dtype=dtype))
            runners.append(StageRunner(decoders[key]))
        leader = new_leader(files, LocalPipeline(runners), ServingOptions(context_length=512, max_batch=4))
        try:
            out = []
            for text in PROMPTS:
                ids = files.tokenizer.encode(files.tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                                             add_special_tokens=False)
                out.append([e.token_id for e in leader.generate(ids, SamplingParams(temperature=0.0, max_tokens=60))
                            if e.token_id is not None])
            return out
        finally:
            leader.close()

    whole = run([0, 30])
    assert run([0, 15, 30]) == whole
    assert run([0, 7, 19, 30]) == whole
    first = decoders[(0, 15)]
    hidden = first(torch.tensor([1, 2, 3]), torch.arange(3), [SeqSlice(SequenceKV(first.kv_layout(), 3), 0, 3)])
    assert hidden.dtype == torch.float32  # what the next stage receives, on the wire too
