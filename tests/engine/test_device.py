"""--device places weights, KV caches and compute on a GPU. No GPU is lent to CI here, so the
device tests skip with the reason; the refusals for a device this machine lacks run everywhere."""

from __future__ import annotations

import pytest
import torch

from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.errors import BadRequest
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
