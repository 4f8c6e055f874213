"""The leader's chores never ask the stages to drop and keep the same block in one step, so
the order a stage applies them in cannot lose a block the leader's index still lists."""

from __future__ import annotations

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.step import Publish
from meshllm.pipeline.chores import StageChores


def test_a_block_evicted_then_published_again_is_only_published():
    chores = StageChores()
    chores.drop([5, 6])
    chores.keep(Publish(SeqId(1), 0, (5,)))
    release, publish, evict = chores.take()
    assert publish == (Publish(SeqId(1), 0, (5,)),) and evict == (6,)
    assert not chores


def test_a_block_published_then_evicted_is_only_evicted():
    chores = StageChores()
    chores.keep(Publish(SeqId(1), 0, (5,)))
    chores.keep(Publish(SeqId(1), 1, (7,)))
    chores.drop([5])
    _, publish, evict = chores.take()
    assert publish == (Publish(SeqId(1), 1, (7,)),) and evict == (5,)


def test_a_step_that_fails_in_process_still_frees_what_it_releases_on_every_stage(aidreams_path):
    """As over gRPC (test_stage_resources.py): the leader counts a failed step's chores done, so the
    stages after the one that failed it apply them anyway."""
    import torch

    from meshllm.engine.stage_runner import StageRunner
    from meshllm.engine.stage_weights import load_stage_decoder
    from meshllm.engine.step import SeqWork, Step
    from meshllm.model.source import open_model
    from meshllm.pipeline.transport import LocalPipeline, next_step_id

    files = open_model(aidreams_path)
    runners = [StageRunner(load_stage_decoder(files.source, files.config, a, b, torch.float32))
               for a, b in ((0, 2), (2, 4))]
    pipeline = LocalPipeline(runners)
    try:
        def step(*works, release=()):
            ids = torch.ones(sum(w.num_tokens for w in works), dtype=torch.int64)
            return pipeline.run_now(Step(next_step_id(), works, ids, release))

        assert step(SeqWork(SeqId(1), 0, 3), SeqWork(SeqId(2), 0, 3)).ok
        # Fails on the first stage, after its chores (a sequence it never saw continues at 5).
        assert step(SeqWork(SeqId(3), 5, 1), release=(SeqId(1),)).error_code == "kv_missing"
        assert [SeqId(1) in r.cache.sequences for r in runners] == [False, False]
    finally:
        pipeline.close()
