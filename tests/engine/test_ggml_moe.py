"""Mixtures of experts on ggml's path: the router's top experts through ggml's expert product
(mul_mat_id), against the torch path (which matches transformers, tests/model/test_decoder.py).

Dense float32 experts (tiny random Qwen3-MoE, Mixtral and GPT-OSS from transformers) agree to
float32 rounding over chunked prefill, whole prefill and decode steps (GPT-OSS: biases on the
router and experts through ggml's add_id, the softmax over the chosen logits, the clamped SwiGLU,
and its attention sinks through ggml's flash attention). Quantized experts (GGUF files laid
out as llama.cpp lays them out) stay quantized, in ggml's plain layout, and two stages give one
stage's logits bit for bit.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.engine import triton_blocks
from meshllm.engine.device_weights import BlockLinear, DeviceBlockForm
from meshllm.engine.ggml_stage import GGMLStage
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.decoder import MoE
from meshllm.model.gguf import GGUFSource
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model
from meshllm.model.weights import SafetensorsSource
from tests.engine.test_ggml_few_rows import verify_pass_and_steps
from tests.engine.test_ggml_sliding_window import _logits, assert_ggml_matches_torch
from tests.model.test_gguf import write_model_gguf
from tests.quantized_gguf import write_quantized_llama

SEQS = [[(7 * i + 13 * j) % 90 + 3 for j in range(20)] for i in range(3)]


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral", "gpt-oss", "glm4-moe", "minimax-m2", "qwen2-moe"])
@pytest.mark.parametrize("prompt_len, chunk", [(8, 3), (20, 20), (2, 2)],
                         ids=["chunked-prefill", "prefill", "mostly-decode"])
def test_dense_experts_on_ggml_match_the_torch_path(rt, tiny_model_dir, variant, prompt_len, chunk):
    source = SafetensorsSource(tiny_model_dir(variant))
    decoder = load_stage_decoder(source, source.config())
    assert isinstance(decoder.fast_path, GGMLStage) and isinstance(decoder.layers[-1].mlp, MoE)
    assert_ggml_matches_torch(decoder, SEQS, prompt_len, chunk, atol=1e-4)  # 3e-6 measured


@pytest.fixture(scope="module", params=[("qwen3moe", GGML.Q4_K), ("llama", GGML.Q8_0), ("qwen3moe", GGML.Q4_1),
                                        ("gpt-oss", GGML.MXFP4), ("glm4moe", GGML.Q8_0), ("minimax-m2", GGML.Q4_0),
                                        ("qwen2moe", GGML.Q8_0)],
                ids=["qwen3moe-Q4_K", "mixtral-Q8_0", "qwen3moe-Q4_1", "gpt-oss-MXFP4", "glm4moe-Q8_0",
                     "minimax-m2-Q4_0", "qwen2moe-Q8_0"])
def quantized(rt, smollm2_gguf_path, tiny_model_dir, tmp_path_factory, request):
    arch, ggml_type = request.param
    variants = {"gpt-oss": "gpt-oss", "glm4moe": "glm4-moe", "minimax-m2": "minimax-m2", "qwen2moe": "qwen2-moe"}
    if arch in variants:  # the tiny transformers model converted as llama.cpp would, experts quantized
        variant = variants[arch]
        path = write_model_gguf(tiny_model_dir(variant), tmp_path_factory.mktemp("moe") / f"{arch}.gguf", arch,
                                experts_type=ggml_type)
        source = GGUFSource(path)
        return SimpleNamespace(source=source, config=source.config()), ggml_type
    path = write_quantized_llama(rt, smollm2_gguf_path, tmp_path_factory.mktemp("moe") / "moe.gguf", ggml_type,
                                 arch=arch, experts=4)
    return open_model(path), ggml_type


def test_a_released_mxfp4_folder_loads_as_its_gguf(rt, tiny_model_dir, tmp_path):
    # GPT-OSS as OpenAI releases it (MXFP4 safetensors) keeps its experts MXFP4, in the bytes
    # llama.cpp's converter would write to a GGUF, so it runs as that GGUF does, bit for bit
    from meshllm.engine.stage_weights import held_weight_bytes
    from tests.model.test_weights import released_gpt_oss_folder

    dense = tiny_model_dir("gpt-oss")
    files = GGUFSource(write_model_gguf(dense, tmp_path / "gpt-oss.gguf", "gpt-oss", experts_type=GGML.MXFP4))
    files = SimpleNamespace(source=files, config=files.config())
    folder = SafetensorsSource(released_gpt_oss_folder(dense, tmp_path / "gpt-oss"))
    decoder = load_stage_decoder(folder, folder.config())
    mlp = decoder.layers[0].mlp
    assert all(experts.weight_types == ["MXFP4"] for experts in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    # the planner counts the blocks' bytes, as for the GGUF (whose other tensors are float32)
    assert held_weight_bytes(folder, folder.config(), 4) == held_weight_bytes(files.source, files.config, 4)
    # as the folder's config says (a GGUF has no key for the tiny model's SwiGLU limit, 7 in GPT-OSS's
    # own, and its eps is rounded to float32)
    config = replace(files.config, swiglu_limit=folder.config().swiglu_limit, rms_norm_eps=folder.config().rms_norm_eps)
    want = _logits(load_stage_decoder(files.source, config), SEQS, 8, 3, True, torch.float32)
    for a, b in zip(_logits(decoder, SEQS, 8, 3, True, torch.float32), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_quantized_experts_stay_quantized_one_3d_matrix_each(quantized, rt):
    """Each projection's experts are one [cols, rows, experts] tensor: MXFP4 ones re-laid out by
    ggml where this CPU has kernels for it, the others in its plain layout
    (ggml_lib.REPACKED_EXPERT_TYPES says why)."""
    files, ggml_type = quantized
    decoder = load_stage_decoder(files.source, files.config)
    mlp = decoder.layers[-1].mlp
    assert isinstance(decoder.fast_path, GGMLStage) and isinstance(mlp, MoE)
    for experts in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        (matrix,) = experts.matrices
        assert experts.weight_types == [ggml_type.name] and matrix.experts == files.config.num_experts == 4
        assert list(matrix.tensor.contents.ne[:3]) == [matrix.cols, matrix.rows // 4, 4]
        assert matrix.repacked == (ggml_type == GGML.MXFP4 and rt.lib.ggml_cpu_has_avx2())
    # The two paths' products differ in their last bits (ggml's few-row and tiled kernels against
    # one-expert products), which on random quantized weights can cross an activation's
    # quantization step; the dense test above checks the routing and sums, this that both paths
    # run (the torch path multiplies one repacked expert through ggml's expert product).
    fast = _logits(decoder, SEQS, 8, 3, True, torch.float32)
    slow = _logits(decoder, SEQS, 8, 3, False, torch.float32)
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(fast, slow))
    assert agree >= 0.9 * sum(len(a) for a in fast), agree


def test_a_verify_pass_of_quantized_experts_scores_what_one_row_steps_score(quantized):
    # ggml's repacked expert product runs row by row (its gemv), so rows sharing an expert in a
    # verify pass get what each gets alone (in bf16: the GPT-OSS file's float32 attention weights
    # would run ggml's float32 products, which differ by row count for any model)
    files, _ = quantized
    verify, steps = verify_pass_and_steps(load_stage_decoder(files.source, files.config, dtype=torch.bfloat16), 5)
    assert torch.equal(verify, steps)


def test_two_stages_of_quantized_experts_give_one_stage_logits(quantized):
    files, _ = quantized
    whole = load_stage_decoder(files.source, files.config)
    first = load_stage_decoder(files.source, files.config, 0, 1)
    second = load_stage_decoder(files.source, files.config, 1, files.config.num_hidden_layers)
    want = _logits(whole, SEQS, 8, 3, True, torch.float32)
    got = _logits([first, second], SEQS, 8, 3, True, torch.float32)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_experts_in_the_gpu_form_give_the_dense_experts_logits_bitwise(quantized, monkeypatch):
    # The GPU forms (engine/device_weights.py) are plain torch modules: here on the CPU they run
    # as on a GPU, but for the fused kernel (CUDA, tests/engine/test_device_families.py; off here
    # even under TRITON_INTERPRET, since it sums in another order). Each expert's product reads
    # only its rows of the experts matrix, dequantized as the dense model was at load.
    monkeypatch.setattr(triton_blocks, "ENABLED", False)
    files, _ = quantized
    compact = load_decoder(files.source, files.config, weight_form=DeviceBlockForm(torch.device("cpu"), torch.float32))
    dense = load_decoder(files.source, files.config)
    mlp = compact.layers[-1].mlp
    assert isinstance(mlp, MoE)
    assert all(isinstance(m, BlockLinear) and len(m.types) == 1 for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    for seq in SEQS:
        ids = torch.tensor(seq)
        assert torch.equal(compact.forward_full(ids), dense.forward_full(ids))


def test_a_gguf_lists_each_expert_as_a_row_range_of_its_stacked_tensor(quantized):
    files, ggml_type = quantized
    source, config = files.source, files.config
    from meshllm.model import moe

    stacked = source.file.tensors["blk.1.ffn_down_exps.weight"]
    gate, up, down = moe.expert_names(config.model_type, 1, 3)
    assert source.tensor_shapes()[down] == stacked.shape[1:]
    raw = source.file.raw(stacked)  # [experts * rows, bytes per row]
    rows = stacked.shape[1]
    assert torch.equal(source.read_blocks(down).data, torch.from_numpy(raw[3 * rows:4 * rows].copy()))
    assert Path(source.path).stat().st_size > 0


def test_experts_keep_their_rows_under_the_cpu_weight_forms(tiny_model_dir):
    """Without ggml the torch path swaps linears for int8 or packed bf16 forms; the experts
    matrices, multiplied one expert's rows at a time, stay nn.Linear (found by review: every
    MoE forward raised AttributeError there)."""
    from meshllm.engine.cpu_weights import quantize_int8
    from meshllm.model.loader import load_decoder

    source = SafetensorsSource(tiny_model_dir("qwen3-moe"))
    decoder = load_decoder(source, source.config())
    ids = torch.tensor(SEQS[0])
    want = decoder.forward_full(ids)
    quantize_int8(decoder)
    mlp = decoder.layers[0].mlp
    assert type(mlp.gate_proj) is torch.nn.Linear and type(decoder.layers[0].self_attn.o_proj) is not torch.nn.Linear
    got = decoder.forward_full(ids)
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # attention in int8 now; the experts exact


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral", "gpt-oss", "glm4-moe", "minimax-m2", "qwen2-moe"])
def test_batch_invariant_experts_give_a_row_the_same_bits_in_any_batch(tiny_model_dir, variant):
    """Each expert multiplies however many rows chose it: in batch-invariant mode that product is
    tiled like every other, and its activation runs row by row (found by review: 3e-8 apart alone
    and among 8)."""
    from meshllm.engine.batch_invariant import make_batch_invariant
    from meshllm.engine.kv_cache import SequenceKV
    from meshllm.model.decoder import SeqSlice
    from meshllm.model.loader import load_decoder

    source = SafetensorsSource(tiny_model_dir(variant))
    decoder = make_batch_invariant(load_decoder(source, source.config()))
    seqs = [[(5 * i + 11 * j) % 90 + 3 for j in range(9)] for i in range(8)]

    def logits(batch: list[list[int]]) -> torch.Tensor:
        kvs = [SequenceKV(decoder.kv_layout(), 16) for _ in batch]
        slices, row = [], 0
        for kv, seq in zip(kvs, batch):
            slices.append(SeqSlice(kv, row, len(seq)))
            row += len(seq)
        return decoder(torch.tensor([t for seq in batch for t in seq]),
                       torch.cat([torch.arange(len(seq)) for seq in batch]), slices)

    alone = logits(seqs[:1])
    among = logits(seqs)[:len(seqs[0])]
    assert torch.equal(alone, among)
