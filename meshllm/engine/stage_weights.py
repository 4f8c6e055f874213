"""Load a stage's layers in the form they run fastest in: the one entry point every load path calls.

`load_stage_decoder` is what the stage service, the in-process leader and `generate` call:
it reads layers [first, last) and decides the weight form once, for all of them:

- GGUF block-quantized tensors (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, ...) stay quantized, held
  and multiplied by ggml (engine/quantized.py), unless ggml is not available or batch-invariant
  mode is on; then they are dequantized to `dtype` as before.
- `quantization="int8"|"int4"` quantizes a 16/32-bit model's layer linears at load, tensor by
  tensor (ggml Q8_0 / Q4_0 blocks); without ggml, int8 falls back to torch's per-row int8.
- everything else keeps the dense forms of engine/weight_forms.py.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGML
from torch import nn

from meshllm.cluster.stage_budget import WeightBytes
from meshllm.engine import ggml_stage
from meshllm.engine.ggml_lib import Runtime, runtime
from meshllm.engine.ggml_weights import KEPT_TYPES, BlockMatrix, GGMLMatrix, held_block_bytes, linear_block_parts
from meshllm.engine.host_memory import back_with_huge_pages, return_freed_memory
from meshllm.engine.quantized import FileRowsEmbedding, QuantizedEmbedding, QuantizedLinear, ggml_matrices
from meshllm.engine.batch_invariant import make_batch_invariant
from meshllm.engine.cuda_graphs import graphed
from meshllm.engine.device_weights import BlockEmbedding, BlockLinear, DeviceBlockForm, warm_fused_kernels
from meshllm.engine.weight_forms import QUANTIZATIONS, prepare_for_cpu
from meshllm.errors import BadRequest, ModelLoadError
from meshllm.model.config import ModelConfig
from meshllm.model.decoder import Decoder
from meshllm.model.loader import load_decoder
from meshllm.model.weights import TensorSource

log = logging.getLogger(__name__)

# --quantize name -> the ggml block type a 16/32-bit weight is quantized to at load
QUANTIZE_TYPES = {"int8": GGML.Q8_0, "int4": GGML.Q4_0}


class GGMLWeightForm:
    """loader.WeightForm: GGUF blocks kept as they are, or dense weights quantized to `quantize_to`;
    an embedding table no head shares left in the file, its rows read per lookup (`_embedding_in_file`)."""

    def __init__(self, rt: Runtime, quantize_to: GGML | None, dtype: torch.dtype):
        self.rt, self.quantize_to, self.dtype = rt, quantize_to, dtype

    def _blocks(self, source: TensorSource, name: str) -> BlockMatrix | None:
        is_blocks = getattr(source, "is_block_quantized", None)
        if is_blocks is None or not is_blocks(name):
            return None
        matrix = source.read_blocks(name)
        if matrix.ggml_type not in KEPT_TYPES:
            raise ModelLoadError(f"{source.path}: {name} is {matrix.ggml_type.name}, which meshllm does not run "
                                 f"quantized; use a GGUF of {', '.join(t.name for t in KEPT_TYPES)}")
        return matrix

    def linear(self, source: TensorSource, hf_names: list[str], rows: list[int]) -> nn.Module | None:
        parts = linear_block_parts(source, hf_names, rows, self._blocks, self.rt, self.quantize_to)
        if parts is None:
            return None
        # An experts matrix is one 3-d tensor, as ggml's expert product (mul_mat_id) reads it, re-laid
        # out for some types (ggml_lib.REPACKED_EXPERT_TYPES says which and why).
        experts = any(".experts." in name for name in hf_names)
        linear = QuantizedLinear.from_parts(self.rt, parts, experts=experts)
        if experts and len(linear.matrices) != 1:
            raise ModelLoadError(f"{source.path}: the experts of {hf_names[0]!r} and the others are stored in "
                                 f"different types ({', '.join(sorted({p.ggml_type.name for p in parts}))}); "
                                 f"meshllm needs one type per experts matrix")
        return linear

    def embedding(self, source: TensorSource, hf_name: str, shape: torch.Size,
                  shared_with_head: bool) -> nn.Module | None:
        if not shared_with_head:
            in_file = _embedding_in_file(self.rt, source, hf_name, shape, self.dtype)
            if in_file is not None:
                return in_file
        table = self._blocks(source, hf_name)
        if table is None:
            return None
        _check_shape(source, hf_name, table.shape, shape)
        # Plain (not repacked) layout: get_rows reads it, and a tied LM head multiplies the same copy.
        return QuantizedEmbedding(self.rt, GGMLMatrix(self.rt, table, repack=False), torch.float32)

    def tied_head(self, embedding: nn.Module) -> nn.Module | None:
        if isinstance(embedding, QuantizedEmbedding):
            return QuantizedLinear([embedding.table])
        return None


def _embedding_in_file(rt: Runtime, source: TensorSource, hf_name: str, shape: torch.Size,
                       dtype: torch.dtype) -> nn.Module | None:
    """An embedding table no LM head shares, left in the model file and read a few rows at a time
    (gguf.FileRows says why); None where the source cannot (not a GGUF, a type meshllm does not
    keep quantized, a float type other than `dtype`), and the table is loaded as the others are.
    Not for a table the head shares: the head reads all of it every step, and re-lays it out
    (ggml_stage)."""
    if getattr(source, "file_rows", None) is None:
        return None
    if source.is_block_quantized(hf_name) and source.block_type(hf_name) not in KEPT_TYPES:
        return None  # the copying path names the type in its error
    found = source.file_rows(hf_name, dtype)
    if found is None:
        return None
    rows, ggml_type, stored_shape = found
    _check_shape(source, hf_name, stored_shape, shape)
    return FileRowsEmbedding(rt, rows, ggml_type, stored_shape, dtype)


def _check_shape(source: TensorSource, hf_name: str, found: tuple[int, ...], shape: torch.Size) -> None:
    if tuple(found) != tuple(shape):
        raise ModelLoadError(f"{source.path}: tensor {hf_name!r} has shape {tuple(found)}, expected {tuple(shape)}")


def load_stage_decoder(source: TensorSource, config: ModelConfig, first_layer: int = 0,
                       last_layer: int | None = None, dtype: torch.dtype = torch.float32,
                       quantization: str | None = None, batch_invariant: bool = False,
                       progress=None, device: str = "cpu") -> Decoder:
    """Layers [first_layer, last_layer) of `source` in their fastest form (see the module docstring)."""
    if quantization is not None and quantization not in QUANTIZE_TYPES:
        raise BadRequest(f"unknown quantization {quantization!r}; supported: {', '.join(QUANTIZE_TYPES)}")
    if device != "cpu":
        return _load_on_device(source, config, first_layer, last_layer, dtype, quantization, batch_invariant,
                               progress, device)
    if batch_invariant and quantization is not None:
        raise BadRequest("batch-invariant mode runs 16/32-bit weights; drop the quantization")
    rt = None if batch_invariant else runtime()
    if rt is None:
        if quantization == "int4":
            raise BadRequest("--quantize int4 needs ggml (built by install.sh), which is not available here; "
                             "use --quantize int8 or no quantization")
        decoder = load_decoder(source, config, first_layer, last_layer, dtype, progress)
        return prepare_for_cpu(decoder, quantization if quantization in QUANTIZATIONS else None, batch_invariant)
    form = GGMLWeightForm(rt, QUANTIZE_TYPES.get(quantization), dtype)
    decoder = load_decoder(source, config, first_layer, last_layer, dtype, progress, weight_form=form)
    return_freed_memory()  # the read buffers freed during loading
    why_not = ggml_stage.supports(decoder)
    log.info("layers [%d, %d) of %s: weights %s", first_layer, decoder.last_layer, source.path,
             describe_weights(decoder))
    if why_not is None:
        decoder.fast_path = ggml_stage.GGMLStage(rt, decoder)  # the linears stay as ggml reads them
    else:
        log.debug("whole-layer ggml path unused for %s: %s", source.path, why_not)
        decoder = prepare_for_cpu(decoder, None, batch_invariant=False)
    _weights_in_huge_pages(decoder)
    return decoder


def _weights_in_huge_pages(decoder: Decoder) -> None:
    """Every decode step streams the weights: in 2 MiB pages (host_memory says why). Stages on
    ggml's path only: the others (no ggml here, or batch-invariant mode) are fallbacks and
    references, not what serves."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # the memory held, views or not
                for t in (*decoder.parameters(), *decoder.buffers()) if t.device.type == "cpu"}
    spans = [(start, start + size) for start, size in storages.items()]
    spans += [span for m in ggml_matrices(decoder) for span in m.spans()]
    started = time.perf_counter()
    collapsed = back_with_huge_pages(spans)
    if collapsed:
        log.debug("weights: %.0f MiB in 2 MiB pages (%.2f s)", collapsed / 2**20, time.perf_counter() - started)


def _load_on_device(source: TensorSource, config: ModelConfig, first_layer: int, last_layer: int | None,
                    dtype: torch.dtype, quantization: str | None, batch_invariant: bool, progress,
                    device: str) -> Decoder:
    """Weights, KV and compute on a GPU (`--device cuda[:N]|mps`).

    ggml's kernels here are its CPU backend's, so on a GPU GGUF blocks stay blocks on the device,
    dequantized by torch inside each product (engine/device_weights.py); --quantize makes such
    blocks from 16/32-bit weights with ggml's quantizer. Dense weights are held in `dtype`. In
    batch-invariant mode every weight is dense (its tiled products are dense ones).
    """
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BadRequest(f"unknown device {device!r}; use cpu, cuda, cuda:N or mps") from None
    available = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available}.get(dev.type)
    if available is None:
        raise BadRequest(f"unknown device {device!r}; use cpu, cuda, cuda:N or mps")
    if not available():
        raise BadRequest(f"--device {device}: this machine's torch has no {dev.type.upper()} device; use cpu")
    if batch_invariant:
        if quantization is not None:
            raise BadRequest("batch-invariant mode runs 16/32-bit weights; drop the quantization")
        return make_batch_invariant(load_decoder(source, config, first_layer, last_layer, dtype, progress).to(dev))
    # --quantize's Q8_0 / Q4_0 by ggml's quantizer, or without a ggml build the gguf package's
    # (the same bytes, slower)
    rt = runtime() if quantization is not None else None
    form = DeviceBlockForm(dev, dtype, QUANTIZE_TYPES.get(quantization), rt)
    decoder = load_decoder(source, config, first_layer, last_layer, dtype, progress, weight_form=form).to(dev)
    log.info("layers [%d, %d) of %s on %s: weights %s", first_layer, decoder.last_layer, source.path, device,
             describe_weights(decoder))
    warm_fused_kernels(decoder, dtype)
    return graphed(decoder)


def decoder_bytes(decoder: Decoder) -> int:
    """Weight bytes a stage holds: torch parameters and buffers, plus the matrices ggml holds."""
    tensors = {id(t): t for t in (*decoder.parameters(), *decoder.buffers())}
    dense = sum(t.numel() * t.element_size() for t in tensors.values())
    return dense + sum(m.num_bytes for m in ggml_matrices(decoder))


def describe_weights(decoder: Decoder) -> str:
    """E.g. "ggml Q4_1 63.0 MiB, Q8_0 28.1 MiB; dense 0.1 MiB" (logs: what a stage holds, and how)."""
    held: dict[str, int] = {}
    for m in ggml_matrices(decoder):
        held[m.ggml_type.name] = held.get(m.ggml_type.name, 0) + m.num_bytes
    seen: set[int] = set()  # a tied head shares the embedding's blocks
    for module in decoder.modules():
        if isinstance(module, BlockLinear | BlockEmbedding):
            for data, ggml_type in module.blocks():
                if id(data) not in seen:
                    seen.add(id(data))
                    held[ggml_type.name] = held.get(ggml_type.name, 0) + data.numel()
    dense = sum(p.numel() * p.element_size() for p in decoder.parameters())
    quantized = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sorted(held.items()))
    kind = "blocks" if seen else "ggml"
    return f"{kind} {quantized}; dense {dense / 2**20:.1f} MiB" if held else f"dense {dense / 2**20:.1f} MiB"


def held_weight_bytes(source: TensorSource, config: ModelConfig, dtype_bytes: int,
                      quantization: str | None = None, batch_invariant: bool = False) -> WeightBytes | None:
    """What the weights take in memory in the form load_stage_decoder gives them; None when that
    is simply parameters × dtype bytes (no ggml, batch-invariant mode, or nothing quantized)."""
    rt = None if batch_invariant else runtime()
    if rt is None:
        return None
    is_blocks = getattr(source, "is_block_quantized", lambda _: False)
    quantize_to = QUANTIZE_TYPES.get(quantization)
    if quantize_to is None and not any(is_blocks(n) for n in source.tensor_names()):
        return None
    shapes = source.tensor_shapes()

    def held(name: str, linear: bool) -> int:
        if is_blocks(name):  # linears are repacked (a Q4_1 one may grow: split_q4_1), tables are not
            size = source.block_bytes(name)
            splits = linear and ".experts." not in name  # an experts matrix is never split (GGMLMatrix)
            return held_block_bytes(rt, source.block_type(name), shapes[name][0], size) if splits else size
        count = math.prod(shapes[name])
        if linear and quantize_to is not None:
            block, block_bytes = GGML_QUANT_SIZES[quantize_to]
            return count // block * block_bytes
        return count * dtype_bytes

    def layer(i: int) -> int:
        names = [n for n in shapes if n.startswith(f"model.layers.{i}.") and not n.endswith("rotary_emb.inv_freq")]
        return sum(held(n, linear=shapes[n].__len__() == 2) for n in names)

    embedding = held("model.embed_tokens.weight", linear=False)
    lm_head = embedding if config.tie_word_embeddings else held("lm_head.weight", linear=True)
    return WeightBytes(layer=max(layer(i) for i in range(config.num_hidden_layers)), embedding=embedding,
                       final_norm=held("model.norm.weight", linear=False), lm_head=lm_head,
                       embedding_in_file=_embedding_stays_in_file(source, "model.embed_tokens.weight"))


def _embedding_stays_in_file(source: TensorSource, hf_name: str) -> bool:
    """Whether a CPU stage whose head does not share this table reads its rows from the file
    (_embedding_in_file) rather than holding it: a block-quantized table of a kept type in a source
    that reads rows. A float table qualifies only in the stage's own dtype, which the budget does
    not know: it counts as held (the safe side)."""
    is_blocks = getattr(source, "is_block_quantized", None)
    return (getattr(source, "file_rows", None) is not None and is_blocks is not None and is_blocks(hf_name)
            and source.block_type(hf_name) in KEPT_TYPES)
