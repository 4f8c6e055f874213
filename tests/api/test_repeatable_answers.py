"""In batch-invariant mode a prompt asked again after a prefix-cache hit is answered exactly as
the first time: the cached blocks and the tail computed after the hit give the logits a cold
prefill gives. (The default kernels do not promise this; the README says why.) Real weights
(SmolLM2 Q4_1, dequantized in this mode), real HTTP, the official client."""

from __future__ import annotations

SYSTEM = ("You are a careful assistant for a lighthouse museum. Answer in plain sentences, keep to the "
          "facts the visitor gives you, and never invent dates, names or places that were not given.")


def test_a_repeated_prompt_is_answered_the_same_after_a_prefix_cache_hit(smollm2_server):
    client = smollm2_server.client()
    model = smollm2_server.backend.model_id
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0, "no prefix-cache hit: nothing was tested"
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens  # a tail was computed
    assert second.choices[0].message.content == first.choices[0].message.content
