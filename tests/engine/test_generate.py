"""The local generate loop on the real aidreams-260k model: against transformers, batched
against solo, seeds, stop strings, logprobs, and context overflow."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from meshllm.engine.generate import Completion, check_fits
from meshllm.pipeline.local_generate import generate, generate_many, stream_many
from meshllm.engine.sampler import SamplingParams
from meshllm.errors import BadRequest, ContextOverflow
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model

PROMPTS = ["Echoes of vectors", "A gentle hum of precision and", "I dream"]


@pytest.fixture(scope="module")
def model(aidreams_path):
    files = open_model(aidreams_path)
    return files, load_decoder(files.source, files.config)


def _ids(files, text: str) -> list[int]:
    return files.tokenizer.encode(text)


def test_greedy_matches_transformers_generate(model, aidreams_path):
    files, decoder = model
    reference = AutoModelForCausalLM.from_pretrained(aidreams_path, dtype=torch.float32).eval()
    for text in PROMPTS:
        ids = _ids(files, text)
        with torch.no_grad():
            want = reference.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                      pad_token_id=0)[0, len(ids):].tolist()
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        [got] = generate_many(decoder, files.tokenizer, [ids], params)
        assert list(got.token_ids) == want
        assert "".join(generate(decoder, files.tokenizer, ids, params)) == files.tokenizer.decode(want)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=4),
                                      dict(temperature=1.2, top_k=20, seed=5)])
def test_batched_equals_solo(model, sampling):
    files, decoder = model
    prompts = [_ids(files, t) for t in PROMPTS]  # different lengths share every decode step
    params = [SamplingParams(max_tokens=24 + 4 * i, **sampling) for i in range(len(prompts))]
    batched = generate_many(decoder, files.tokenizer, prompts, params)
    solo = [generate_many(decoder, files.tokenizer, [p], [q])[0] for p, q in zip(prompts, params)]
    assert batched == solo
    assert [len(c.token_ids) for c in batched] == [24, 28, 32] or any(c.finish_reason == "stop" for c in batched)


def test_the_same_seed_gives_the_same_text_and_another_seed_another(model):
    files, decoder = model
    ids = _ids(files, PROMPTS[0])

    def run(seed: int | None) -> Completion:
        return generate_many(decoder, files.tokenizer, [ids], SamplingParams(temperature=1.0, seed=seed,
                                                                            max_tokens=40, ignore_eos=True))[0]

    assert run(123) == run(123)
    assert len({run(seed).token_ids for seed in (1, 2, 3)}) > 1
    assert len({run(None).token_ids for _ in range(3)}) > 1  # no seed: a fresh one each time


def test_a_stop_string_ends_the_text_before_it(model):
    files, decoder = model
    ids = _ids(files, PROMPTS[0])
    greedy = generate_many(decoder, files.tokenizer, [ids], SamplingParams(temperature=0.0, max_tokens=40))[0]
    stop = greedy.text[12:17]
    assert stop and stop not in greedy.text[:12]
    [stopped] = generate_many(decoder, files.tokenizer, [ids],
                              SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == greedy.text[:greedy.text.index(stop)]


def test_deltas_carry_logprobs_and_one_finish_reason(model):
    files, decoder = model
    ids = _ids(files, PROMPTS[1])
    deltas = list(stream_many(decoder, files.tokenizer, [ids], [SamplingParams(temperature=0.0, max_tokens=6,
                                                                                logprobs=2)]))
    assert len(deltas) == 6
    assert [d.finish_reason for d in deltas] == [None] * 5 + ["length"]
    for d in deltas:
        assert d.logprobs.token_id == d.token_id == d.logprobs.top_ids[0]  # greedy picks the most likely
        assert d.logprobs.logprob <= 0.0


class _EosAs:
    """The model's tokenizer, but with `eos` as its end-of-sequence id (aidreams never emits its own)."""

    def __init__(self, tokenizer, eos: int):
        self.tokenizer, self.eos_token_ids = tokenizer, (eos,)

    def decode_stream(self, context=()):
        return self.tokenizer.decode_stream(context=context)


def test_eos_finishes_with_stop_and_is_not_emitted(model):
    files, decoder = model
    ids = _ids(files, PROMPTS[2])
    params = SamplingParams(temperature=0.0, max_tokens=30)
    free = generate_many(decoder, files.tokenizer, [ids], params)[0]
    eos = free.token_ids[10]
    cut = free.token_ids.index(eos)  # its first appearance
    [stopped] = generate_many(decoder, _EosAs(files.tokenizer, eos), [ids], params)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:cut + 1]
    assert stopped.text == files.tokenizer.decode(list(free.token_ids[:cut]))
    [ignored] = generate_many(decoder, _EosAs(files.tokenizer, eos), [ids],
                              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert ignored == free


def test_prefill_in_chunks_gives_the_same_tokens(model):
    files, decoder = model
    ids = _ids(files, " ".join(PROMPTS) * 2)
    params = [SamplingParams(temperature=0.0, max_tokens=16)]
    whole = list(stream_many(decoder, files.tokenizer, [ids], params))
    chunked = list(stream_many(decoder, files.tokenizer, [ids], params, prefill_chunk=7))
    assert [d.token_id for d in chunked] == [d.token_id for d in whole]


def test_prompt_plus_max_tokens_beyond_the_context_is_a_clear_error(model):
    files, decoder = model
    context = files.config.max_position_embeddings  # 128
    ids = _ids(files, PROMPTS[0])
    with pytest.raises(ContextOverflow) as e:
        list(generate(decoder, files.tokenizer, ids, SamplingParams(max_tokens=context)))
    assert f"{len(ids)} tokens" in str(e.value) and str(context) in str(e.value)
    assert str(context - len(ids)) in str(e.value)  # the largest max_tokens that fits
    with pytest.raises(ContextOverflow, match="Shorten the prompt"):
        check_fits(context, SamplingParams(max_tokens=1), context)
    check_fits(context - 1, SamplingParams(max_tokens=1), context)  # exactly full is fine
    with pytest.raises(BadRequest):
        check_fits(0, SamplingParams(), context)
