"""The whole-layer ggml graph (Decoder.fast_path) against the torch path on the same weights.

A tiny random Llama GGUF (Q4_0, so the repacked kernels run) is loaded once; the torch path is
the same Decoder with fast_path removed (torch ops around the same ggml matrix products). Both
quantize activations to 8-bit blocks inside the products, in slightly different places, so
logits agree to a stated tolerance (atol 2e-2 on logits of magnitude ~3), not bitwise. The
reused decode graph, which is patched step to step instead of rebuilt, must agree with a freshly
built graph bitwise.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.engine.ggml_lib import runtime
from meshllm.engine.ggml_stage import GGMLStage
from meshllm.engine.kernels.custom_ops import q8_0x8_ops, q8_few_rows_op
from meshllm.engine.kv_cache import SequenceKV
from meshllm.engine.quantized import QuantizedLinear
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.decoder import SeqSlice
from meshllm.model.source import open_model
from tests.quantized_gguf import write_quantized_llama

ATOL = 2e-2


@pytest.fixture(scope="module")
def tiny_q4_0(smollm2_gguf_path, tmp_path_factory):
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    return write_quantized_llama(rt, smollm2_gguf_path, tmp_path_factory.mktemp("q") / "tiny.gguf", GGML.Q4_0)


@pytest.fixture(scope="module")
def decoder(tiny_q4_0):
    files = open_model(tiny_q4_0)
    d = load_stage_decoder(files.source, files.config)
    assert isinstance(d.fast_path, GGMLStage)
    return d


def _run(decoder, prompts: list[list[int]], steps: int, fast: bool) -> list[torch.Tensor]:
    """Prefill the prompts as one batch, then `steps` batched decode steps; logits of each step."""
    saved = decoder.fast_path
    decoder.fast_path = saved if fast else None
    try:
        kvs = [SequenceKV(decoder.kv_layout(), 8) for _ in prompts]  # small: decode grows them
        ids = torch.tensor([t for p in prompts for t in p])
        positions = torch.cat([torch.arange(len(p)) for p in prompts])
        slices, row = [], 0
        for kv, p in zip(kvs, prompts):
            slices.append(SeqSlice(kv, row, len(p)))
            row += len(p)
        ends = torch.tensor([s.row + s.num_tokens - 1 for s in slices])
        out = [decoder(ids, positions, slices, ends)]
        for _ in range(steps):
            tokens = out[-1].argmax(dim=-1)
            positions = torch.tensor([kv.length for kv in kvs])
            out.append(decoder(tokens, positions, [SeqSlice(kv, i, 1) for i, kv in enumerate(kvs)],
                               torch.arange(len(kvs))))
        return out
    finally:
        decoder.fast_path = saved


PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], [8, 8, 19], [4000, 12, 12, 12, 5]]


def test_fast_path_matches_torch_path(decoder):
    fast, slow = _run(decoder, PROMPTS, 12, True), _run(decoder, PROMPTS, 12, False)
    for step, (a, b) in enumerate(zip(fast, slow)):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=f"step {step}")


def test_reused_decode_graph_equals_a_fresh_one(decoder, monkeypatch):
    reused = _run(decoder, PROMPTS, 12, True)  # grows the KV tensors past 8: rebuilds, then reuses
    monkeypatch.setattr(GGMLStage, "_reuse_key", staticmethod(lambda *a: None))
    fresh = _run(decoder, PROMPTS, 12, True)
    for a, b in zip(reused, fresh):
        assert torch.equal(a, b)


def _swap_midway(decoder) -> list[torch.Tensor]:
    """Decode A, B and C together, then A, B and a new sequence D in C's place (as many rows: the
    same graph key), then D alone; logits of every step."""
    layout = decoder.kv_layout()
    kvs = {name: SequenceKV(layout, 32) for name in "ABCD"}
    prompts = dict(zip("ABCD", PROMPTS + [[7, 7, 300, 1]]))
    for name, kv in kvs.items():
        p = prompts[name]
        decoder(torch.tensor(p), torch.arange(len(p)), [SeqSlice(kv, 0, len(p))], torch.tensor([len(p) - 1]))
    out = []
    for names in ["ABC"] * 3 + ["ABD"] * 3 + ["D"] * 2:
        seqs = [kvs[n] for n in names]
        tokens = torch.tensor([(len(out) * 31 + 7 * i) % 4000 + 3 for i in range(len(seqs))])
        out.append(decoder(tokens, torch.tensor([kv.length for kv in seqs]),
                           [SeqSlice(kv, i, 1) for i, kv in enumerate(seqs)], torch.arange(len(seqs))))
    return out


@pytest.fixture(scope="module")
def bf16_decoder(tiny_q4_0):
    """On a bf16 KV cache few-row steps take the batched form: one graph whatever the sequences,
    which a table patched per step points at them."""
    files = open_model(tiny_q4_0)
    d = load_stage_decoder(files.source, files.config, dtype=torch.bfloat16)
    if d.fast_path._batched_ops is None:
        pytest.skip("the batched few-row attention (AVX-512) does not run here")
    return d


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_a_reused_graph_follows_a_changed_set_of_sequences(kv, request, monkeypatch):
    """A kept graph is patched, not rebuilt, when another sequence takes a finished one's place:
    what it reads (each sequence's KV, rows and start) must follow, as a fresh graph's would."""
    decoder = request.getfixturevalue("decoder" if kv == "float32" else "bf16_decoder")
    reused = _swap_midway(decoder)
    monkeypatch.setattr(GGMLStage, "_reuse_key", staticmethod(lambda *a: None))
    fresh = _swap_midway(decoder)
    for step, (a, b) in enumerate(zip(reused, fresh)):
        assert torch.equal(a, b), f"step {step}"


def test_rollback_then_decode_recomputes_the_same_logits(decoder):
    kv = SequenceKV(decoder.kv_layout(), 64)
    prompt = torch.tensor(PROMPTS[0])
    decoder(prompt, torch.arange(len(prompt)), [SeqSlice(kv, 0, len(prompt))], torch.tensor([len(prompt) - 1]))
    first = [decoder(torch.tensor([t]), torch.tensor([kv.length]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
             for t in (3, 4, 5)]
    kv.truncate(len(prompt) + 1)  # reject the last two (speculative rollback)
    again = [decoder(torch.tensor([t]), torch.tensor([kv.length]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
             for t in (4, 5)]
    assert torch.equal(first[1], again[0]) and torch.equal(first[2], again[1])


def test_a_prefill_chunk_without_logit_rows_still_writes_the_kv(smollm2_gguf_path, tmp_path):
    """A few-row prefill chunk that asks for no logits (not the prompt's last) must still write its
    KV. In the batched few-row form (bf16 KV) the writes feed only their layer's attention, which
    nothing read without logits: the KV stayed unwritten and the next chunk's logits were NaN (or,
    over zeroed memory, silently wrong). The prompt in chunks of 16 rows (no logits) and 5, against
    the same tokens one row at a time: the same bits."""
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    files = open_model(write_quantized_llama(rt, smollm2_gguf_path, tmp_path / "tiny.gguf", GGML.Q8_0))
    decoder = load_stage_decoder(files.source, files.config, dtype=torch.bfloat16)
    if decoder.fast_path._batched_ops is None or q8_few_rows_op() is None:
        pytest.skip("the batched few-row form and the Q8_0 few-row op (AVX-512, VNNI) do not run here")
    kv = SequenceKV(decoder.kv_layout(), 32)
    ids = torch.arange(100, 121)
    decoder(ids[:16], torch.arange(16), [SeqSlice(kv, 0, 16)], torch.tensor([], dtype=torch.long))
    chunked = decoder(ids[16:], torch.arange(16, 21), [SeqSlice(kv, 0, 5)], torch.tensor([4]))
    kv = SequenceKV(decoder.kv_layout(), 32)
    for i in range(21):
        one_row = decoder(ids[i:i + 1], torch.tensor([i]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
    assert torch.equal(chunked, one_row)


def test_q8_0_layers_are_relaid_and_a_prefill_chunk_scores_what_its_rows_score_as_steps(smollm2_gguf_path, tmp_path):
    """A Q8_0 model's layer matrices take meshllm's 8-row layout (ggml_stage._relay_q8_0), whose op
    computes each row alone at any row count: with the attention op (bf16 KV, no window) a whole
    40-row chunk then gives the logits of 40 one-row steps, bit for bit."""
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    files = open_model(write_quantized_llama(rt, smollm2_gguf_path, tmp_path / "tiny.gguf", GGML.Q8_0))
    decoder = load_stage_decoder(files.source, files.config, dtype=torch.bfloat16)
    if q8_0x8_ops() is None or decoder.fast_path._attention_op is None:
        pytest.skip("the 8-row Q8_0 and attention ops (AVX-512, VNNI) do not run here")
    layouts = {m.layout for layer in decoder.layers for m in layer.modules() if isinstance(m, QuantizedLinear)
               for m in m.matrices}
    assert layouts == {"q8_0x8"}, layouts
    ids = torch.arange(300, 340)
    kv = SequenceKV(decoder.kv_layout(), 40)
    chunk = decoder(ids, torch.arange(40), [SeqSlice(kv, 0, 40)], torch.arange(40))
    kv = SequenceKV(decoder.kv_layout(), 40)
    steps = torch.cat([decoder(ids[i:i + 1], torch.tensor([i]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
                       for i in range(40)])
    assert torch.equal(chunk, steps)


_TWO_THREADS = """
import ctypes, sys, threading, time
import torch
from meshllm.engine import ggml_weights
from meshllm.engine.kv_cache import SequenceKV
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.decoder import SeqSlice
from meshllm.model.source import open_model

# Every block over 16 KiB mapped on its own and unmapped when freed: a graph computing in an
# allocator buffer another thread freed then faults instead of quietly reading stale memory.
assert ctypes.CDLL(None).mallopt(-3, 16 << 10) == 1  # M_MMAP_THRESHOLD
files = open_model(sys.argv[1])
decoder = load_stage_decoder(files.source, files.config)

class DelayedLock:  # a thread descheduled between its graph's allocation and its compute
    def __init__(self, lock):
        self.lock = lock
    def __enter__(self):
        time.sleep(0.002)
        return self.lock.__enter__()
    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)

def prefill_and_decode(first):
    out = []
    for length in range(8 + first % 2 * 4, 240, 8):  # each prompt longer than any before: the allocator grows
        kv = SequenceKV(decoder.kv_layout(), length + 4)
        ids = torch.arange(first, first + length)
        out.append(decoder(ids, torch.arange(length), [SeqSlice(kv, 0, length)], torch.tensor([length - 1])))
        for _ in range(2):
            token = out[-1].argmax(dim=-1)
            out.append(decoder(token, torch.tensor([kv.length]), [SeqSlice(kv, 0, 1)], torch.tensor([0])))
    return out

serial = [prefill_and_decode(100), prefill_and_decode(2001)]
ggml_weights._COMPUTE_LOCK = DelayedLock(ggml_weights._COMPUTE_LOCK)
for attempt in range(3):
    decoder.fast_path._drop_cached()  # start over: new graphs, the allocator grown again
    decoder.fast_path.g.ggml_gallocr_free(decoder.fast_path._allocator)
    decoder.fast_path._allocator = decoder.fast_path.g.ggml_gallocr_new(decoder.fast_path.rt.cpu_buffer_type)
    results = [None, None]
    def run(i):
        try:
            results[i] = prefill_and_decode((100, 2001)[i])
        except BaseException as e:
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, serial):
        assert not isinstance(got, BaseException), repr(got)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"attempt {attempt}: logits differ"
print("same")
"""


def test_two_threads_stepping_one_stage_get_their_serial_logits(tiny_q4_0):
    """Plans over the same layers share one GGMLStage, each plan with its own compute lock, so two
    plans' steps can reach it at once. Its prefill allocator is freed and replaced when a larger
    graph comes: unserialized, one thread computed in a buffer the other had just freed (in a
    node, whose large blocks are unmapped when freed, a crash) and the graph cache was walked
    while changed. In a child process (it may crash): two threads each prefill prompts of growing
    length and decode; both must get the logits a serial run gets."""
    done = subprocess.run([sys.executable, "-c", _TWO_THREADS, str(tiny_q4_0)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and done.stdout.strip() == "same", (done.returncode, done.stderr[-2000:])


def test_a_kept_decode_graph_does_not_hold_a_finished_sequences_kv(tiny_q4_0):
    """Decode graphs over float32 KV point at each sequence's KV and are kept for the next step;
    when the sequence ends its KV must go at once, not when a later step drops the graph (an idle
    stage would hold every finished batch's KV)."""
    files = open_model(tiny_q4_0)
    decoder = load_stage_decoder(files.source, files.config, dtype=torch.float32)
    kv = SequenceKV(decoder.kv_layout(), 16)
    decoder(torch.tensor(PROMPTS[0]), torch.arange(7), [SeqSlice(kv, 0, 7)], torch.tensor([6]))
    for token in (3, 4, 5):
        decoder(torch.tensor([token]), torch.tensor([kv.length]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
    assert decoder.fast_path._cached, "the decode graph is kept"
    k = weakref.ref(kv.k)
    del kv
    gc.collect()
    assert k() is None


def test_sixteen_sequences_fit_one_graph(decoder):
    # A graph too small for the batch aborts the process inside ggml (GGML_ASSERT), so this
    # guards the capacity estimate: 16 sequences of a prefill and decode steps.
    prompts = [[3 + i, 40 + i, 500 + i] for i in range(16)]
    fast, slow = _run(decoder, prompts, 2, True), _run(decoder, prompts, 2, False)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def test_dropping_a_ggml_stage_frees_its_matrices_at_once(smollm2_gguf_path, tmp_path):
    """Unload (failover's shared weights) drops the last reference to a decoder: its ggml buffers must
    go then, not whenever the cycle collector runs, and decoder_bytes must have counted them."""
    import gc
    import weakref

    from meshllm.engine.quantized import ggml_matrices
    from meshllm.engine.stage_weights import decoder_bytes

    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    path = write_quantized_llama(rt, smollm2_gguf_path, tmp_path / "tiny.gguf", GGML.Q8_0)
    files = open_model(path)
    d = load_stage_decoder(files.source, files.config)
    matrices = ggml_matrices(d)
    held = sum(m.num_bytes for m in matrices)
    assert matrices and decoder_bytes(d) >= held > 0.8 * path.stat().st_size  # the rest: tokenizer metadata
    refs = [weakref.ref(m) for m in matrices]
    del matrices
    gc.disable()  # freed by reference counting alone
    try:
        del d
        assert all(r() is None for r in refs), "a reference cycle keeps ggml matrices alive after the stage is dropped"
    finally:
        gc.enable()


def test_a_long_prefill_on_bf16_kv_is_as_accurate_as_short_chunks(smollm2_gguf_path, tmp_path):
    """A prefill chunk of 64+ queries on bf16 KV attends through ggml's tiled kernel over an exact
    f32 copy of the KV; chunks under 64 queries take the row-at-a-time kernel on the bf16 KV itself
    (which rounds the queries to bf16 too). Against the same model in fp32 (fp32 KV), the long
    chunk's logits must be no further off than the short chunks': the rounding of the KV to bf16
    is what both pay (logits of this random model span ~400; both stray ~0.2 on average)."""
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    files = open_model(write_quantized_llama(rt, smollm2_gguf_path, tmp_path / "tiny.gguf", GGML.Q8_0))
    ids = torch.randint(3, 40000, (150,), generator=torch.Generator().manual_seed(0))

    def prefill(dtype: torch.dtype, chunk: int) -> torch.Tensor:
        d = load_stage_decoder(files.source, files.config, dtype=dtype)
        kv, out = SequenceKV(d.kv_layout(), 150), []
        assert kv.k.dtype == dtype
        for start in range(0, 150, chunk):
            end = min(150, start + chunk)
            out.append(d(ids[start:end], torch.arange(start, end), [SeqSlice(kv, 0, end - start)],
                         torch.arange(end - start)))
        return torch.cat(out)

    reference = prefill(torch.float32, 150)
    whole, chunked = (prefill(torch.bfloat16, n) - reference for n in (150, 30))
    assert whole.abs().mean() <= 1.05 * chunked.abs().mean()
    assert whole.abs().max() <= 1.1 * chunked.abs().max()
    assert chunked.abs().mean() < 1e-3 * reference.abs().max()  # and neither is far off


def test_q4_1_remainder_op_matches_ggmls_own_ops_and_the_torch_path(smollm2_gguf_path, tmp_path):
    """A Q4_1 model's linears are held as Q4_0 plus a per-block remainder (group-major). Where
    meshllm's few-row op is not built, ggml's product takes the Q4_0 part and the remainder is added
    by meshllm's custom op (q4_remainder.c) or, without it, by ggml's sum_rows + out_prod + add over
    a permuted copy of it. All three give the same logits to float rounding, and the torch path's
    (GGMLMatrix.matmul) within ATOL. (With the few-row op turned off here: it would take every
    product on a CPU with AVX-512 VNNI and leave the two fallbacks untested.)"""
    from meshllm.engine.kernels.custom_ops import q4_remainder_op

    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    if q4_remainder_op() is None:
        pytest.skip("the remainder op is not built here (python -m meshllm.engine.kernels.build)")
    files = open_model(write_quantized_llama(rt, smollm2_gguf_path, tmp_path / "q41.gguf", GGML.Q4_1))
    d = load_stage_decoder(files.source, files.config)
    assert all(m.remainder is not None for layer in d.layers for m in layer.mlp.gate_up_proj.matrices)
    few_rows = _run(d, PROMPTS, 4, True)
    d.fast_path._drop_cached()
    d.fast_path._quant_few_rows_ops = {}
    with_op = _run(d, PROMPTS, 4, True)
    d.fast_path._drop_cached()
    d.fast_path._remainder_op = None
    with_ggml_ops = _run(d, PROMPTS, 4, True)
    torch_path = _run(d, PROMPTS, 4, False)
    for f, a, b, c in zip(few_rows, with_op, with_ggml_ops, torch_path):
        scale = float(c.abs().max())
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale)
        torch.testing.assert_close(f, a, rtol=0, atol=1e-5 * scale)  # the few-row op against ggml's products
        # The two paths round activations to 8 bits in different places (see the module docstring).
        torch.testing.assert_close(a, c, rtol=0, atol=1e-3 * scale)


def test_a_q4_1_remainder_in_float16_gives_every_path_the_bits_of_float32(smollm2_gguf_path, monkeypatch):
    """split_q4_1 holds a remainder in float16 where its values are all float16s (118 of the
    shipped model's 120 Q4_1 matrices): each path (meshllm's few-row op, its remainder op after
    ggml's product, ggml's own ops, the torch path) reads the same float32 values from it, so its
    logits are bitwise those of the same model with every remainder held in float32."""
    from meshllm.engine import ggml_weights
    from meshllm.engine.kernels.custom_ops import q4_remainder_op

    if runtime() is None or q4_remainder_op() is None:
        pytest.skip("ggml or the remainder op is not built here")
    files = open_model(smollm2_gguf_path)

    def every_path() -> list[torch.Tensor]:
        d = load_stage_decoder(files.source, files.config)
        out = _run(d, PROMPTS, 2, True)
        d.fast_path._drop_cached()
        d.fast_path._quant_few_rows_ops = {}
        out += _run(d, PROMPTS, 2, True)
        d.fast_path._drop_cached()
        d.fast_path._remainder_op = None
        return out + _run(d, PROMPTS, 2, True) + _run(d, PROMPTS, 2, False)

    halves = every_path()
    split = ggml_weights.split_q4_1
    held = []
    monkeypatch.setattr(ggml_weights, "split_q4_1", lambda m: (lambda q, r: (held.append(r.dtype), (q, r.float()))[1])(
        *split(m)))
    singles = every_path()
    assert held.count(torch.float16) >= 0.9 * len(held)
    assert all(torch.equal(h, s) for h, s in zip(halves, singles))


def test_generated_tokens_recomputed_in_decode_sized_pieces_get_the_kv_bits_they_had(smollm2_gguf_path):
    """What a failover's re-prefill relies on (Scheduler._work_for): in the default kernels the
    prompt in its own chunk, then the generated tokens in pieces of up to 16 rows, write the KV
    the prefill and one-row decode steps wrote, bit for bit. On this model (Q4_1) one chunk across
    both does too: its products (ggml_stage.ALL_ROWS_OPS) and its attention run meshllm's ops at
    any number of rows, each row computed alone (on types whose prefill takes ggml's GEMM, as the
    K-quants and bf16, one chunk's bits differ from the pieces')."""
    files = open_model(smollm2_gguf_path)
    decoder = load_stage_decoder(files.source, files.config, dtype=torch.bfloat16)
    if decoder.fast_path is None or decoder.fast_path._batched_ops is None or q8_few_rows_op() is None:
        pytest.skip("the few-row kernels (AVX-512, VNNI) do not run here: nothing promises these bits")
    prompt = files.tokenizer.encode("Tell me a story about a robot who learns to paint.")
    generated = [(7 * i + 11) % 4000 + 3 for i in range(40)]
    ids = prompt + generated

    def kv_after(pieces: list[int]) -> SequenceKV:
        kv = SequenceKV(decoder.kv_layout(), len(ids) + 1)
        start = 0
        for n in pieces:
            decoder(torch.tensor(ids[start:start + n]), torch.arange(start, start + n), [SeqSlice(kv, 0, n)],
                    torch.tensor([n - 1]))
            start += n
        return kv

    first = kv_after([len(prompt)] + [1] * len(generated))  # how they were first computed
    again = kv_after([len(prompt), 16, 16, 8])
    assert torch.equal(first.k[:, :, :len(ids)], again.k[:, :, :len(ids)])
    assert torch.equal(first.v[:, :, :len(ids)], again.v[:, :, :len(ids)])
    across = kv_after([len(ids)])
    assert torch.equal(first.k[:, :, :len(ids)], across.k[:, :, :len(ids)])
    assert torch.equal(first.v[:, :, :len(ids)], across.v[:, :, :len(ids)])
