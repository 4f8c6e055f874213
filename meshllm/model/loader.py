"""Build a Decoder for layers [first, last) from a TensorSource, reading only those tensors.

One explicit name map from Hugging Face tensor names to our parameters; q/k/v
and gate/up are concatenated at load so each runs as one matmul.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import Tensor, nn

from meshllm.errors import ModelLoadError
from meshllm.model import gemma, moe
from meshllm.model.config import ModelConfig
from meshllm.model.decoder import Decoder
from meshllm.model.weights import TensorSource

# our parameter name -> HF names concatenated along dim 0 to form it
NameMap = dict[str, list[str]]
_MODULE_WEIGHTS = (".qkv_proj.weight", ".o_proj.weight", ".gate_up_proj.weight", ".down_proj.weight",
                   ".mlp.gate_proj.weight", ".mlp.up_proj.weight")  # the last two: experts matrices


class WeightForm(Protocol):
    """Decides, tensor by tensor while loading, which linears and embeddings take another form
    (engine/stage_weights.py: ggml-quantized). Returning None keeps the dense nn module."""

    def linear(self, source: TensorSource, hf_names: list[str], rows: list[int]) -> nn.Module | None: ...

    def embedding(self, source: TensorSource, hf_name: str, shape: torch.Size,
                  shared_with_head: bool) -> nn.Module | None: ...

    def tied_head(self, embedding: nn.Module) -> nn.Module | None: ...


def name_map(config: ModelConfig, first_layer: int, last_layer: int) -> NameMap:
    names: NameMap = {}
    if first_layer == 0:
        names["embed_tokens.weight"] = ["model.embed_tokens.weight"]
    for local, i in enumerate(range(first_layer, last_layer)):
        hf, ours = f"model.layers.{i}", f"layers.{local}"
        attn = f"{hf}.self_attn"
        names[f"{ours}.input_layernorm.weight"] = [f"{hf}.input_layernorm.weight"]
        if config.sandwich_norms and config.model_type == "glm4":  # GLM's own names for the two after
            names[f"{ours}.post_attention_layernorm.weight"] = [f"{hf}.post_attention_layernorm.weight"]
            names[f"{ours}.attn_out_norm.weight"] = [f"{hf}.post_self_attn_layernorm.weight"]
            names[f"{ours}.mlp_out_norm.weight"] = [f"{hf}.post_mlp_layernorm.weight"]
        elif config.sandwich_norms:  # Gemma: HF's post_attention_layernorm follows attention, not the MLP's input
            names[f"{ours}.post_attention_layernorm.weight"] = [f"{hf}.pre_feedforward_layernorm.weight"]
            names[f"{ours}.attn_out_norm.weight"] = [f"{hf}.post_attention_layernorm.weight"]
            names[f"{ours}.mlp_out_norm.weight"] = [f"{hf}.post_feedforward_layernorm.weight"]
        else:
            names[f"{ours}.post_attention_layernorm.weight"] = [f"{hf}.post_attention_layernorm.weight"]
        names[f"{ours}.self_attn.qkv_proj.weight"] = [f"{attn}.{p}_proj.weight" for p in "qkv"]
        if config.attention_bias:
            names[f"{ours}.self_attn.qkv_proj.bias"] = [f"{attn}.{p}_proj.bias" for p in "qkv"]
        if config.qk_norm:
            names[f"{ours}.self_attn.q_norm.weight"] = [f"{attn}.q_norm.weight"]
            names[f"{ours}.self_attn.k_norm.weight"] = [f"{attn}.k_norm.weight"]
        names[f"{ours}.self_attn.o_proj.weight"] = [f"{attn}.o_proj.weight"]
        if config.o_proj_bias:
            names[f"{ours}.self_attn.o_proj.bias"] = [f"{attn}.o_proj.bias"]
        if config.attention_sinks:
            names[f"{ours}.self_attn.sinks"] = [f"{attn}.sinks"]
        if config.layer_is_moe(i):  # each projection: every expert's rows, expert after expert
            experts = [moe.expert_names(config.model_type, i, e) for e in range(config.num_experts)]
            names[f"{ours}.mlp.router.weight"] = [moe.router_name(config.model_type, i)]
            for index, projection in enumerate(("gate_proj", "up_proj", "down_proj")):
                names[f"{ours}.mlp.{projection}.weight"] = [names_of[index] for names_of in experts]
            if config.expert_biases:
                names[f"{ours}.mlp.router.bias"] = [moe.router_bias_name(i)]
                biases = [moe.expert_bias_names(i, e) for e in range(config.num_experts)]
                for index, projection in enumerate(("gate_proj", "up_proj", "down_proj")):
                    names[f"{ours}.mlp.{projection}.bias"] = [names_of[index] for names_of in biases]
            if config.sigmoid_router:
                names[f"{ours}.mlp.selection_bias"] = [moe.selection_bias_name(config.model_type, i)]
            if config.shared_expert_gated:
                names[f"{ours}.mlp.shared_gate.weight"] = [moe.shared_gate_name(i)]
            if config.shared_expert_size:
                gate, up, down = moe.shared_expert_names(config.model_type, i)
                names[f"{ours}.mlp.shared.gate_up_proj.weight"] = [gate, up]
                names[f"{ours}.mlp.shared.down_proj.weight"] = [down]
        else:
            names[f"{ours}.mlp.gate_up_proj.weight"] = [f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"]
            names[f"{ours}.mlp.down_proj.weight"] = [f"{hf}.mlp.down_proj.weight"]
    if last_layer == config.num_hidden_layers:
        names["norm.weight"] = ["model.norm.weight"]
        names["lm_head.weight"] = ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return names


_INIT_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """Skip nn modules' random init while building on meta: every weight is read from the file
    next, and init on meta tensors goes through torch's reference ops, whose first use imports
    torch._dynamo and sympy (~800 modules: 2-8 s of a node's first Load on a small CPU)."""
    names = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
             "trunc_normal_", "zeros_", "ones_", "constant_")
    with _INIT_PATCH_LOCK:  # loads in parallel threads must not save each other's no-ops
        saved = {name: getattr(nn.init, name) for name in names}
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


def load_decoder(source: TensorSource, config: ModelConfig, first_layer: int = 0, last_layer: int | None = None,
                 dtype: torch.dtype = torch.float32,
                 progress: Callable[[int, int], None] | None = None,
                 weight_form: WeightForm | None = None) -> Decoder:
    """Load layers [first_layer, last_layer) (whole model by default) in `dtype`.

    Reads only the tensors of that range from `source`. `progress(done, total)` is
    called as parameters load (the CLI draws a bar). `weight_form` may swap linears and the
    embedding for other modules (quantized ones) as their tensors are read, so no dense
    copy of a swapped weight is ever made.
    """
    last_layer = config.num_hidden_layers if last_layer is None else last_layer
    if not 0 <= first_layer < last_layer <= config.num_hidden_layers:
        raise ModelLoadError(f"{source.path}: layer range [{first_layer}, {last_layer}) is not inside the "
                             f"model's {config.num_hidden_layers} layers")
    with torch.device("meta"), _no_weight_init():
        decoder = Decoder(config, first_layer, last_layer, dtype)
    names = name_map(config, first_layer, last_layer)
    expected = {name: p.shape for name, p in decoder.named_parameters()}
    assert set(expected) == set(names), set(expected) ^ set(names)
    available = set(source.tensor_names())
    _reject_unused_layer_tensors(source, available, names, first_layer, last_layer)
    # The tied LM head shares the embedding's storage when a stage holds both: read it once.
    shares_embedding = config.tie_word_embeddings and "embed_tokens.weight" in names and "lm_head.weight" in names
    state: dict[str, Tensor] = {}
    for done, (ours, hf_names) in enumerate(names.items()):
        # A swapped-in module holds its weights its own way, none of them a parameter of this name.
        swapped = weight_form is not None and _swap_module(decoder, weight_form, source, available, config,
                                                           ours, hf_names, expected[ours], shares_embedding)
        if not swapped:
            state[ours] = state["embed_tokens.weight"] if shares_embedding and ours == "lm_head.weight" else \
                _load_one(source, available, config, ours, hf_names, expected[ours], dtype)
        if progress:
            progress(done + 1, len(names))
    assert set(state) == {name for name, _ in decoder.named_parameters()}, "swapped modules left parameters"
    decoder.load_state_dict(state, assign=True, strict=True)
    return decoder


def _swap_module(decoder: Decoder, form: WeightForm, source: TensorSource, available: set[str],
                 config: ModelConfig, ours: str, hf_names: list[str], shape: torch.Size,
                 shares_embedding: bool) -> bool:
    """Put `form`'s module in place of the one owning parameter `ours`; False when it declines."""
    is_linear = ours.endswith(_MODULE_WEIGHTS) or ours == "lm_head.weight"
    if not is_linear and ours != "embed_tokens.weight":
        return False
    for hf in hf_names:
        if hf not in available:
            raise ModelLoadError(f"{source.path}: tensor {hf!r} is missing (needed for {ours}); "
                                 f"the checkpoint does not match its config.json")
    path = ours.removesuffix(".weight")
    old = decoder.get_submodule(path)
    if ours == "embed_tokens.weight":
        module = form.embedding(source, hf_names[0], shape, shared_with_head=shares_embedding)
    elif ours == "lm_head.weight" and shares_embedding:
        module = form.tied_head(decoder.embed_tokens)
    else:
        module = form.linear(source, hf_names, _part_rows(config, ours, shape, len(hf_names)))
    if module is None:
        return False
    if isinstance(old, nn.Linear) and old.bias is not None:  # loaded next by load_state_dict
        module.bias = nn.Parameter(torch.empty_like(old.bias), requires_grad=False)
    parent, _, name = path.rpartition(".")
    setattr(decoder.get_submodule(parent) if parent else decoder, name, module)
    return True


def _load_one(source: TensorSource, available: set[str], config: ModelConfig, ours: str, hf_names: list[str],
              shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """One of our parameters: the HF tensors, each shape-checked, concatenated along dim 0."""
    for hf in hf_names:
        if hf not in available:
            raise ModelLoadError(f"{source.path}: tensor {hf!r} is missing (needed for {ours}); "
                                 f"the checkpoint does not match its config.json")
    # Gemma's norms scale by 1 + w: added, and kept, in float32 as transformers computes them (in
    # bf16 the 1 would leave w a step of 1/128); its GGUF stores 1 + w in float32 (llama.cpp's)
    gemma_norm = config.model_type in gemma.MODEL_TYPES and ours.endswith(_NORM_WEIGHTS)
    # GLM-4.5's router and the bias that picks its experts: float32 too (decoder.MoE says why)
    router = (config.sigmoid_router and ours.endswith((".mlp.router.weight", ".mlp.selection_bias"))
              or ours.endswith(".mlp.shared_gate.weight"))  # Qwen2-MoE's shared expert gate, float32 too
    parts = source.read(hf_names, torch.float32 if gemma_norm or router else dtype)
    if gemma_norm and config.norm_weight_offset:
        parts = {name: t + config.norm_weight_offset for name, t in parts.items()}
    for hf, rows in zip(hf_names, _part_rows(config, ours, shape, len(hf_names))):
        want = (rows, *shape[1:])
        if tuple(parts[hf].shape) != want:
            raise ModelLoadError(f"{source.path}: tensor {hf!r} has shape {tuple(parts[hf].shape)}, expected "
                                 f"{want} from config.json; the checkpoint does not match its config")
    tensor = parts[hf_names[0]] if len(hf_names) == 1 else torch.cat([parts[n] for n in hf_names])
    return tensor.contiguous()


_NORM_WEIGHTS = "norm.weight"  # input_layernorm, q_norm, attn_out_norm, the final norm, ...


def _part_rows(config: ModelConfig, ours: str, shape: torch.Size, parts: int) -> list[int]:
    """Rows each of the `parts` HF tensors contributes to our (possibly fused) parameter: q, k and
    v their heads' rows; the others (gate and up, every expert of an experts matrix) equal shares."""
    if ".qkv_proj." in ours:
        kv = config.num_key_value_heads * config.head_dim
        return [config.num_attention_heads * config.head_dim, kv, kv]
    return [shape[0] // parts] * parts


def _reject_unused_layer_tensors(source: TensorSource, available: set[str], names: NameMap,
                                 first_layer: int, last_layer: int) -> None:
    # A layer tensor we would not read (an o_proj or MLP bias, a new norm) means the checkpoint
    # computes something the decoder does not: refuse rather than give silently wrong logits.
    wanted = {hf for hf_names in names.values() for hf in hf_names}
    prefixes = tuple(f"model.layers.{i}." for i in range(first_layer, last_layer))
    for name in sorted(available):
        # Old Llama checkpoints store the rotary table; we compute it from the config.
        if name.startswith(prefixes) and name not in wanted and not name.endswith("rotary_emb.inv_freq"):
            raise ModelLoadError(f"{source.path}: tensor {name!r} is not used by meshllm's Llama-family "
                                 f"decoder; this checkpoint has parts meshllm does not implement")
