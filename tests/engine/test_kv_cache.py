"""Per-sequence KV: growth, rollback, prefix copy; and the stage's refusal of positions past the context."""

from __future__ import annotations

import pytest
import torch

from meshllm.engine.kv_cache import KVLayout, SequenceKV
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step import SeqWork, Step
from meshllm.errors import MalformedMessage
from meshllm.model.loader import load_decoder
from meshllm.model.weights import SafetensorsSource


def test_growth_doubles_but_never_past_the_context():
    kv = SequenceKV(KVLayout(2, 1, 4, torch.float32, max_tokens=100), capacity=64)
    kv.k[:, :, :10] = 1.0
    kv.length = 10
    kv.reserve(65)
    assert kv.capacity == 100 and bool((kv.k[:, :, :10] == 1.0).all())  # kept what it held
    unbounded = SequenceKV(KVLayout(2, 1, 4, torch.float32), capacity=64)
    unbounded.reserve(65)
    assert unbounded.capacity == 128


def test_truncate_rolls_back_and_refuses_to_grow():
    kv = SequenceKV(KVLayout(1, 1, 2, torch.float32))
    kv.length = 8
    kv.truncate(5)
    assert kv.length == 5
    with pytest.raises(ValueError):
        kv.truncate(6)


def test_stage_refuses_positions_beyond_the_models_context(aidreams_path):
    source = SafetensorsSource(aidreams_path)
    runner = StageRunner(load_decoder(source, source.config()))
    context = source.config().max_position_embeddings
    step = Step(1, (SeqWork(7, context - 2, 3),), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(MalformedMessage, match="beyond the model's context"):
        runner.run(step)
