"""Models and proposers shared by the speculative-decoding tests."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.pipeline.cluster import ServingOptions
from meshllm.spec.proposer import Draft, ProposeRequest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Batch-invariant: a k+1-row verification gives each row the bits of a one-row decode step.
EXACT = ServingOptions(context_length=128, max_batch=8, dtype="float32", batch_invariant=True,
                       scheduler=SchedulerConfig(max_batched_tokens=64, prefill_chunk=32, prefix_block_size=16))
PROMPTS = (
    "Once upon a time, there was a little robot. The robot liked to play. The robot liked to",
    "Lily and Ben went to the park. Lily said: we go to the park, we go to the park, we",
    "The cat sat on the mat. The dog sat on the log. The bird",
)


@pytest.fixture(scope="session")
def random_models(aidreams_path, tiny_model_dir) -> dict[str, Path]:
    """Two random-weight models sharing aidreams' 512-token tokenizer: a target and a draft."""
    models = {}
    for name, variant, seed in (("target", "llama", 11), ("draft", "qwen2", 12)):
        folder = tiny_model_dir(variant, seed=seed, vocab_size=512, num_hidden_layers=3)
        for f in TOKENIZER_FILES:
            shutil.copy(aidreams_path / f, folder / f)
        models[name] = folder
    return models


class GarbageProposer:
    """A proposer that answers wrong things on purpose (stands in for a buggy or hostile peer):
    too many tokens, ids outside the vocabulary, negative ids, malformed q, resyncs to nowhere."""

    name = "garbage"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.calls = 0

    def propose(self, requests: Sequence[ProposeRequest], cancelled=None) -> list[Draft]:
        from meshllm.engine.step import DraftDist

        out = []
        for r in requests:
            self.calls += 1
            kind = self.calls % 5
            if kind == 0:
                out.append(Draft(r.seq_id, tuple(range(3, 3 + 3 * r.k + 5))))  # longer than asked
            elif kind == 1:
                out.append(Draft(r.seq_id, (5, self.vocab_size + 7, 2)))  # out of vocabulary
            elif kind == 2:
                out.append(Draft(r.seq_id, (-4, 9)))
            elif kind == 3:
                out.append(Draft(r.seq_id, (11, 12), (DraftDist((11,), (3.0,)), DraftDist((99,), (1.0,)))))
            else:
                out.append(Draft(r.seq_id, resync_from=10**6))
        return out

    def release(self, seq_ids) -> None:
        pass


class SlowProposer:
    """Wraps a proposer and sleeps before answering: its drafts arrive after the steps they were for."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s
        self.name = f"slow-{inner.name}"

    def propose(self, requests, cancelled=None):
        time.sleep(self.delay_s)
        return self.inner.propose(requests)

    def release(self, seq_ids) -> None:
        self.inner.release(seq_ids)


class RaisingProposer:
    name = "raising"

    def propose(self, requests, cancelled=None):
        raise RuntimeError("proposer crashed")

    def release(self, seq_ids) -> None:
        pass


def seq(n: int) -> SeqId:
    return SeqId(n)
