"""Serving through a 2-stage pipeline of node processes: prefix cache and disconnects,
checked on the stage nodes themselves (Stage.Info over gRPC) and through /metrics."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PREFIX_TOKENS = 512


def test_shared_512_token_prefix_is_a_hit_and_only_the_suffix_is_prefilled(long_cluster_server):
    live = long_cluster_server
    client = live.client()
    model = live.backend.model_id
    block = live.backend.leader.prefix.block_size
    prefix = [3 + (i * 37) % 500 for i in range(PREFIX_TOKENS)]  # token ids: no tokenizer ambiguity
    first = client.completions.create(model=model, prompt=prefix + [7, 8, 9, 10, 11], max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hits_before = live.metric("meshllm_prefix_cache_hit_tokens_total")
    computed_before = live.metric("meshllm_computed_tokens_total")
    suffix = [20, 21, 22, 23, 24, 25, 26]
    second = client.completions.create(model=model, prompt=prefix + suffix, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == PREFIX_TOKENS
    assert live.metric("meshllm_prefix_cache_hit_tokens_total") - hits_before == PREFIX_TOKENS
    # Only the suffix went through the stages for the prompt, then one token per decode step.
    assert live.metric("meshllm_computed_tokens_total") - computed_before == len(suffix) + 4 - 1
    # Every stage holds the prefix blocks (one KV copy per 32-token block).
    for info in live.stage_infos():
        [shard] = [s for s in info.shards if s.plan_id == live.backend.leader.transport.plan_id]
        assert shard.num_prefix_blocks >= PREFIX_TOKENS // block


def test_client_disconnect_frees_the_sequence_on_every_stage(long_cluster_server):
    live = long_cluster_server
    cancelled_before = live.metric("meshllm_finished_sequences_total", {"finish_reason": "cancelled"})
    stream = live.client().completions.create(model=live.backend.model_id, prompt=[1, 5, 9, 13],
                                              max_tokens=1900, temperature=0, stream=True)
    chunks = 0
    for _ in stream:
        chunks += 1
        if chunks == 3:
            break
    plan_id = live.backend.leader.transport.plan_id
    held = [[seq for shard in info.shards if shard.plan_id == plan_id for seq in shard.seq_ids]
            for info in live.stage_infos()]
    assert [len(h) for h in held] == [1, 1] and held[0] == held[1]  # both stages hold its KV mid-stream
    stream.close()  # the client goes away mid-stream
    live.wait_for(lambda: live.metric("meshllm_finished_sequences_total", {"finish_reason": "cancelled"})
                  == cancelled_before + 1, timeout_s=10, what="the sequence to be cancelled")
    live.wait_for(lambda: not live.stage_sequences(), timeout_s=10, what="every stage to free the KV")
    assert len(live.stage_infos()) == 2
