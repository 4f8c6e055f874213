"""Per-token cost of grammar-constrained decoding on CPU, for each installed matcher library
(llguidance, xgrammar, outlines-core), with the SmolLM2 tokenizer (49152 tokens) and a
nested JSON schema (objects, arrays, enums, required fields). This is the measurement
behind meshllm's choice of library (see meshllm/engine/grammar.py).

For each library: the time to compile the schema for the vocabulary, then, over the
tokens of a valid document, the time per token to compute the allowed-token bitmask and
advance the matcher by the token (what the leader does for every constrained token).
Prints one JSON object; libraries that are not installed are reported as such.

    python bench/grammar.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from meshllm.model.source import open_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"], "additionalProperties": False}},
            "required": ["street", "city", "geo"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
        "projects": {"type": "array", "items": {"type": "object", "properties": {
            "title": {"type": "string"}, "status": {"enum": ["open", "closed"]},
            "stars": {"type": "integer"}}, "required": ["title", "status"], "additionalProperties": False}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "projects", "active"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "role": "editor",
            "address": {"street": "12 St James's Square", "city": "London", "geo": {"lat": 51.507, "lon": -0.134}},
            "tags": ["mathematics", "analytical engine", "poetry"],
            "projects": [{"title": "Notes on the Engine", "status": "closed", "stars": 1843},
                         {"title": "Bernoulli numbers", "status": "open"}],
            "active": True}


def _timed_steps(fill, consume, ids: list[int], repeats: int, reset) -> dict:
    per_token = []
    for _ in range(repeats):
        reset()
        for token_id in ids:
            t0 = time.perf_counter()
            fill()
            consume(token_id)
            per_token.append(time.perf_counter() - t0)
    return {"per_token_us_median": 1e6 * statistics.median(per_token),
            "per_token_us_mean": 1e6 * statistics.fmean(per_token),
            "per_token_us_p95": 1e6 * sorted(per_token)[int(0.95 * len(per_token))]}


def bench_llguidance(tokenizer, ids: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                   eos_token=list(tokenizer.eos_token_ids))
    tokenizer_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
    state = {"m": matcher}
    out = _timed_steps(lambda: llguidance.torch.fill_next_token_bitmask(state["m"], mask),
                       lambda t: state["m"].consume_token(t), ids, repeats,
                       lambda: state.__setitem__("m", llguidance.LLMatcher(lltok, grammar)))
    assert not state["m"].is_error(), state["m"].get_error()
    return {"version": llguidance.get_version() if hasattr(llguidance, "get_version") else None,
            "tokenizer_s": tokenizer_s, "compile_s": compile_s, **out}


def bench_xgrammar(tokenizer, ids: list[int], repeats: int) -> dict:
    import transformers
    import xgrammar

    t0 = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size,
                                                   stop_token_ids=list(tokenizer.eos_token_ids))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    mask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)
    state = {"m": xgrammar.GrammarMatcher(compiled)}

    def consume(t):
        assert state["m"].accept_token(t), t

    out = _timed_steps(lambda: state["m"].fill_next_token_bitmask(mask), consume, ids, repeats,
                       lambda: state.__setitem__("m", xgrammar.GrammarMatcher(compiled)))
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, **out}


def bench_outlines_core(tokenizer, ids: list[int], repeats: int) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    from meshllm.model.token_bytes import vocabulary_bytes

    t0 = time.perf_counter()
    eos = tokenizer.eos_token_ids[0]
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocabulary_bytes(tokenizer.backend)):
        if b and i != eos:
            by_bytes.setdefault(b, []).append(i)
    vocab = Vocabulary(eos, by_bytes)
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r"[ ]?"), vocab)
    compile_s = time.perf_counter() - t0
    mask = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
    state = {"g": Guide(index)}
    out = _timed_steps(lambda: state["g"].write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size()),
                       lambda t: state["g"].advance(t, return_tokens=False), ids, repeats,
                       lambda: state.__setitem__("g", Guide(index)))
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, **out}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5, help="passes over the document per library")
    parser.add_argument("--model", default=None, help="model whose tokenizer to use (default: the demo model)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = open_model(args.model).tokenizer
    ids = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    out = {"vocab_size": tokenizer.vocab_size, "document_tokens": len(ids), "repeats": args.repeats, "libraries": {}}
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                        ("outlines_core", bench_outlines_core)):
        try:
            out["libraries"][name] = bench(tokenizer, ids, args.repeats)
        except ImportError as e:
            out["libraries"][name] = {"error": f"not installed ({e.name})"}
        print(json.dumps({name: out["libraries"][name]}), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
