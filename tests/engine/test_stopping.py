"""Stop detection: EOS, stop strings held back across tokens, max_tokens; OpenAI semantics."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stopping import StopChecker
from meshllm.model.tokenizer import Tokenizer

EOS = 0


def _run(pieces: list[str], stop: tuple[str, ...] = (), max_tokens: int = 100, eos_at: int | None = None,
         ignore_eos: bool = False) -> tuple[list[str], str | None, int]:
    """Feed token i (text pieces[i]; EOS at index eos_at); returns deltas, finish_reason, tokens fed."""
    vocab = {i + 1: piece for i, piece in enumerate(pieces)}
    checker = StopChecker(SamplingParams(stop=stop, max_tokens=max_tokens, ignore_eos=ignore_eos), [EOS],
                          lambda token: vocab.get(token, "<eos>"))
    deltas = []
    for i in range(len(pieces)):
        deltas.append(checker.feed(EOS if i == eos_at else i + 1))
        if checker.finished:
            break
    return deltas, checker.finish_reason, checker.num_tokens


def test_text_streams_token_by_token_without_stops():
    deltas, reason, _ = _run(["Hel", "lo", " world"])
    assert deltas == ["Hel", "lo", " world"] and reason is None


def test_a_stop_string_split_over_tokens_is_held_back_and_never_emitted():
    deltas, reason, n = _run(["The end", " is ", "ne", "ar. ", "More"], stop=("near.",))
    assert deltas == ["The end", " is ", "", ""]
    assert "".join(deltas) == "The end is "
    assert reason == "stop" and n == 4


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop():
    deltas, reason, _ = _run(["a ##", "# b", " ##", "#"], stop=("###!",))
    # "##" waits until "# b" shows it is not "###!"; the final "###" could still become it.
    assert deltas == ["a ", "### b", " ", ""]
    assert reason is None


def test_earliest_stop_wins_and_text_after_it_is_dropped():
    deltas, reason, _ = _run(["one. two! three"], stop=("!", "."))
    assert deltas == ["one"] and reason == "stop"


def test_eos_finishes_with_stop_and_flushes_held_text_but_not_its_own():
    deltas, reason, n = _run(["x", "ST", "never"], stop=("STOP",), eos_at=2)
    assert "".join(deltas) == "xST"
    assert reason == "stop" and n == 3


def test_ignore_eos_treats_eos_as_text():
    deltas, reason, _ = _run(["x", "y"], eos_at=1, ignore_eos=True)
    assert deltas == ["x", "<eos>"] and reason is None


def test_max_tokens_finishes_with_length_and_flushes_held_text():
    deltas, reason, n = _run(["a", "b", "S", "T"], stop=("STOP",), max_tokens=3)
    assert "".join(deltas) == "abS"
    assert reason == "length" and n == 3


def test_a_stop_completed_by_the_last_allowed_token_is_a_stop():
    deltas, reason, _ = _run(["a", "b!"], stop=("!",), max_tokens=2)
    assert "".join(deltas) == "ab" and reason == "stop"


def test_feeding_after_the_finish_is_a_bug():
    checker = StopChecker(SamplingParams(max_tokens=1), [EOS], lambda t: "x")
    checker.feed(1)
    with pytest.raises(AssertionError):
        checker.feed(1)


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.text(alphabet="ab!.", max_size=4), min_size=1, max_size=12),
       stop=st.lists(st.text(alphabet="ab!.", min_size=1, max_size=3), max_size=3).map(tuple),
       max_tokens=st.integers(1, 14))
def test_output_is_the_text_up_to_the_first_stop(pieces, stop, max_tokens):
    deltas, reason, n = _run(pieces, stop=stop, max_tokens=max_tokens)
    # Reference: the text of the tokens fed so far, cut at the earliest stop in it.
    fed = "".join(pieces[:n])
    cuts = [i for i in (fed.find(s) for s in stop) if i >= 0]
    if reason == "stop":
        assert "".join(deltas) == fed[:min(cuts)]
        # ... and the stop appeared only with the last token.
        before = "".join(pieces[:n - 1])
        assert not any(s in before for s in stop)
    else:
        assert not cuts
        assert n == min(len(pieces), max_tokens)
        emitted = "".join(deltas)
        if reason == "length":
            assert emitted == fed
        else:  # still running: everything but a possible stop prefix is out
            assert fed.startswith(emitted)
            held = fed[len(emitted):]
            assert held == "" or any(s.startswith(held) for s in stop)


def test_real_tokenizer_multibyte_text_and_a_stop(aidreams_path):
    tokenizer = Tokenizer.from_folder(aidreams_path)
    text = "Dreams of ✨ light, then dark."
    ids = tokenizer.encode(text, add_special_tokens=False)
    checker = StopChecker(SamplingParams(stop=(", then",)), tokenizer.eos_token_ids, tokenizer.decode_stream().step)
    out = ""
    for token in ids:
        out += checker.feed(token)
        if checker.finished:
            break
    assert checker.finish_reason == "stop"
    assert out == tokenizer.decode(ids).split(", then")[0]
    assert "✨" in out


def _releases(pieces: list[str], stop: tuple[str, ...], max_tokens: int = 100) -> tuple[list[str], list[int], str | None]:
    """Deltas and, per feed, how many held tokens it released (StopChecker.released)."""
    vocab = {i + 1: piece for i, piece in enumerate(pieces)}
    checker = StopChecker(SamplingParams(stop=stop, max_tokens=max_tokens), [EOS], lambda token: vocab[token])
    deltas, released = [], []
    for i in range(len(pieces)):
        deltas.append(checker.feed(i + 1))
        released.append(checker.released)
        if checker.finished:
            break
    return deltas, released, checker.finish_reason


def test_the_tokens_of_a_stop_string_are_never_released():
    """Their logprobs must not go out: the text they wrote is not part of the output."""
    deltas, released, reason = _releases(["I'm", " gl", "ad", " to"], stop=(" glad",))
    assert deltas == ["I'm", "", ""] and reason == "stop"
    assert released == [1, 0, 0]  # " gl" was held, then cut with "ad"


def test_a_held_token_goes_out_with_its_text():
    deltas, released, _ = _releases(["a ##", "#", " b"], stop=("###!",))
    assert deltas == ["a ", "", "### b"]
    assert released == [1, 0, 2]  # "#" waited for " b", which showed "###" is no stop


def test_length_releases_every_held_token():
    deltas, released, reason = _releases(["x", "S", "T"], stop=("STOP",), max_tokens=3)
    assert "".join(deltas) == "xST" and reason == "length" and released == [1, 0, 2]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text(alphabet="ab!.", max_size=4), min_size=1, max_size=12),
       stop=st.lists(st.text(alphabet="ab!.", min_size=1, max_size=3), max_size=3).map(tuple),
       max_tokens=st.integers(1, 14))
def test_tokens_are_released_when_their_text_goes_out(pieces, stop, max_tokens):
    """After every feed, each token whose text has begun to go out is released (in order), and no
    more than those plus one (text that only a released token's held tail wrote takes the oldest
    held token along); a length finish releases them all."""
    deltas, released, reason = _releases(pieces, stop, max_tokens)
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    emitted = total = 0
    for i, (delta, n) in enumerate(zip(deltas, released)):
        emitted += len(delta)
        total += n
        fed = i + 1
        begun = sum(1 for s in starts[:fed] if s < emitted)
        if reason == "length" and fed == len(deltas):
            assert total == fed  # the whole text went out, and every token with it
        else:
            assert begun <= total <= min(fed, begun + 1), (i, begun, total)
