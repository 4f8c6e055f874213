"""Build a Decoder for layers [first, last) from a TensorSource, reading only those tensors.

One explicit name map from Hugging Face tensor names to our parameters; q/k/v
and gate/up are concatenated at load so each runs as one matmul.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from meshllm.errors import ModelLoadError
from meshllm.model.config import ModelConfig
from meshllm.model.decoder import Decoder
from meshllm.model.weights import TensorSource

# our parameter name -> HF names concatenated along dim 0 to form it
NameMap = dict[str, list[str]]


def name_map(config: ModelConfig, first_layer: int, last_layer: int) -> NameMap:
    names: NameMap = {}
    if first_layer == 0:
        names["embed_tokens.weight"] = ["model.embed_tokens.weight"]
    for local, i in enumerate(range(first_layer, last_layer)):
        hf, ours = f"model.layers.{i}", f"layers.{local}"
        attn = f"{hf}.self_attn"
        names[f"{ours}.input_layernorm.weight"] = [f"{hf}.input_layernorm.weight"]
        names[f"{ours}.post_attention_layernorm.weight"] = [f"{hf}.post_attention_layernorm.weight"]
        names[f"{ours}.self_attn.qkv_proj.weight"] = [f"{attn}.{p}_proj.weight" for p in "qkv"]
        if config.attention_bias:
            names[f"{ours}.self_attn.qkv_proj.bias"] = [f"{attn}.{p}_proj.bias" for p in "qkv"]
        if config.qk_norm:
            names[f"{ours}.self_attn.q_norm.weight"] = [f"{attn}.q_norm.weight"]
            names[f"{ours}.self_attn.k_norm.weight"] = [f"{attn}.k_norm.weight"]
        names[f"{ours}.self_attn.o_proj.weight"] = [f"{attn}.o_proj.weight"]
        names[f"{ours}.mlp.gate_up_proj.weight"] = [f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"]
        names[f"{ours}.mlp.down_proj.weight"] = [f"{hf}.mlp.down_proj.weight"]
    if last_layer == config.num_hidden_layers:
        names["norm.weight"] = ["model.norm.weight"]
        names["lm_head.weight"] = ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return names


def load_decoder(source: TensorSource, config: ModelConfig, first_layer: int = 0, last_layer: int | None = None,
                 dtype: torch.dtype = torch.float32,
                 progress: Callable[[int, int], None] | None = None) -> Decoder:
    """Load layers [first_layer, last_layer) (whole model by default) in `dtype`.

    `progress(done, total)` is called as parameters load (the CLI draws a bar).
    """
    last_layer = config.num_hidden_layers if last_layer is None else last_layer
    with torch.device("meta"):
        decoder = Decoder(config, first_layer, last_layer, dtype)
    names = name_map(config, first_layer, last_layer)
    expected = {name: p.shape for name, p in decoder.named_parameters()}
    assert set(expected) == set(names), set(expected) ^ set(names)
    available = set(source.tensor_names())
    state: dict[str, Tensor] = {}
    for done, (ours, hf_names) in enumerate(names.items()):
        missing = [n for n in hf_names if n not in available]
        if missing:
            raise ModelLoadError(f"{source.path}: tensor {missing[0]!r} is missing (needed for {ours}, "
                                 f"layers [{first_layer}, {last_layer}))")
        parts = source.read(hf_names, dtype)
        tensor = parts[hf_names[0]] if len(hf_names) == 1 else torch.cat([parts[n] for n in hf_names])
        if tensor.shape != expected[ours]:
            raise ModelLoadError(f"{source.path}: {' + '.join(hf_names)} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(expected[ours])} for this config")
        state[ours] = tensor.contiguous()
        if progress:
            progress(done + 1, len(names))
    # The tied LM head shares the embedding's storage when a stage holds both.
    if "embed_tokens.weight" in state and config.tie_word_embeddings and "lm_head.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    decoder.load_state_dict(state, assign=True, strict=True)
    decoder.rotary = type(decoder.rotary)(config, dtype)  # built on meta above; rebuild on cpu
    return decoder
