"""Sampling controls end to end, in process and through the 2-stage pipeline of node processes:
logit_bias bans and forces tokens, and each greedy token under frequency and presence penalties
is the argmax of the model's own logprobs minus OpenAI's penalty formula over what came before."""

from __future__ import annotations


from .conftest import MODEL

PROMPT = "Once upon a time there was a little"


def _ids_by_text(tokenizer) -> dict[str, int]:
    """Token text as the API shows it -> id (first id for texts several tokens share)."""
    out: dict[str, int] = {}
    for token_id, data in enumerate(tokenizer.token_bytes):
        out.setdefault(data.decode("utf-8", errors="backslashreplace"), token_id)
    return out


def test_logit_bias_forces_and_bans_tokens(server):
    client = server.client()
    tokenizer = server.backend.tokenizer
    the = tokenizer.encode(" the", add_special_tokens=False)[-1]
    forced = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=5,
                                       logit_bias={str(the): 100})
    assert forced.choices[0].text.split() == ["the"] * 5

    first = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=1, logprobs=2)
    top = list(first.choices[0].logprobs.top_logprobs[0])
    ids = _ids_by_text(tokenizer)
    best = ids.get(" " + top[0], ids.get(top[0]))  # the first token's text lost its leading space
    banned = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=1, logprobs=2,
                                       logit_bias={str(best): -100})
    assert banned.choices[0].logprobs.tokens[0] == top[1]  # the runner-up wins


def test_greedy_tokens_follow_the_penalty_formula(server):
    frequency, presence = 0.7, 0.4
    reply = server.client().completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=40,
                                               logprobs=20, frequency_penalty=frequency, presence_penalty=presence)
    plain = server.client().completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=40)
    assert reply.choices[0].text != plain.choices[0].text  # the penalties changed the output
    lp = reply.choices[0].logprobs
    ids = _ids_by_text(server.backend.tokenizer)
    counts: dict[int, int] = {}
    checked = changed = 0
    for i, (token, alternatives) in enumerate(zip(lp.tokens, lp.top_logprobs)):
        def id_of(text: str) -> int:
            return ids.get(" " + text, ids.get(text)) if i == 0 else ids[text]

        def score(text: str, logprob: float) -> float:
            n = counts.get(id_of(text), 0)
            return logprob - frequency * n - presence * (n > 0)

        if token in alternatives:  # the chosen token is among the 20 the reply shows
            best = max(score(t, v) for t, v in alternatives.items())
            assert score(token, alternatives[token]) >= best - 1e-4, (i, token, alternatives)
            checked += 1
            changed += alternatives[token] < max(alternatives.values())  # a penalty overruled the model
        counts[id_of(token)] = counts.get(id_of(token), 0) + 1
    assert checked >= 15 and changed >= 3, (checked, changed)
    assert max(counts.values()) < 40  # not one token over and over
