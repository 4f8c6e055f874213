"""--device places weights, KV caches and compute on a GPU. No GPU is lent to CI here, so the
device tests skip with the reason; the refusals for a device this machine lacks run everywhere."""

from __future__ import annotations

import pytest
import torch

from meshllm.engine.kv_cache import SequenceKV
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.errors import BadRequest
from meshllm.model.decoder import SeqSlice
from meshllm.model.weights import SafetensorsSource
from meshllm.model.source import open_model
from meshllm.pipeline.local_generate import generate_many

AVAILABLE = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_a_missing_device_is_refused_before_loading(aidreams_path, device):
    if AVAILABLE[device]:
        pytest.skip(f"this machine has {device}: nothing to refuse")
    files = open_model(aidreams_path)
    with pytest.raises(BadRequest, match=f"no {device.upper()} device"):
        load_stage_decoder(files.source, files.config, device=device)
    assert files.source.num_bytes_read() == 0


def test_an_unknown_device_is_a_clear_error(aidreams_path):
    files = open_model(aidreams_path)
    with pytest.raises(BadRequest, match="unknown device"):
        load_stage_decoder(files.source, files.config, device="tpu")


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_weights_kv_and_compute_on_the_device_match_cpu(aidreams_path, device):
    if not AVAILABLE[device]:
        pytest.skip(f"no {device} device on this machine (torch {torch.__version__}); run on a GPU host")
    files = open_model(aidreams_path)
    on_device = load_stage_decoder(files.source, files.config, dtype=torch.float32, device=device)
    assert {p.device.type for p in on_device.parameters()} == {device}
    assert on_device.kv_layout().device.type == device
    cpu = load_stage_decoder(files.source, files.config, dtype=torch.float32, batch_invariant=True)
    ids = files.tokenizer.encode("Once upon a time")
    torch.testing.assert_close(on_device.forward_full(torch.tensor(ids)).cpu(), cpu.forward_full(torch.tensor(ids)),
                               atol=1e-3, rtol=1e-3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    [got] = generate_many(on_device, files.tokenizer, [ids], params)
    [want] = generate_many(cpu, files.tokenizer, [ids], params)
    assert got.token_ids == want.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_a_token_sampled_on_the_device_feeds_the_next_step(tiny_model_dir, device, dtype):
    # The step after a sample gets the token where argmax left it (the device) and its position
    # made on the host: both must reach the weights' device. Its KV is read through views of a
    # cache with room to spare (a gap between heads), the layout torch 2.1's memory-efficient CUDA
    # attention misread (pytorch#112577): the step must still give the logits a whole-sequence pass
    # over a cache of exactly its length gives. 64-wide heads, so the fused kernels are eligible.
    if not AVAILABLE[device]:
        pytest.skip(f"no {device} device on this machine (torch {torch.__version__}); run on a GPU host")
    source = SafetensorsSource(tiny_model_dir("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=64))
    decoder = load_stage_decoder(source, source.config(), dtype=dtype, device=device)
    prompt = list(range(3, 40))
    kv = SequenceKV(decoder.kv_layout(), capacity=128)
    logits = decoder(torch.tensor(prompt), torch.arange(len(prompt)), [SeqSlice(kv, 0, len(prompt))],
                     torch.tensor([len(prompt) - 1]))
    token = logits.argmax(dim=-1)
    assert token.device.type == device
    step = decoder(token, torch.tensor([len(prompt)]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
    whole = decoder.forward_full(torch.tensor(prompt + token.tolist()))
    spread = (whole[-1].max() - whole[-1].min()).item()
    # fp32: the kernels' rounding alone; bf16: 8-bit mantissas through 4 layers (a misread cache is ~spread)
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    assert (step[0] - whole[-1]).abs().max().item() < tolerance * spread
    assert (logits[0] - whole[-2]).abs().max().item() < tolerance * spread
