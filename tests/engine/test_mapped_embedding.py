"""An embedding table no LM head shares is read in place from the GGUF file (stage_weights.
maps_embeddings): the same outputs as a copied table, nothing resident until rows are read,
no huge-page collapse of it, and writes never reach the file."""

from __future__ import annotations

import mmap
import os

import pytest
import torch
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.engine.ggml_lib import runtime
from meshllm.engine.ggml_stage import GGMLStage
from meshllm.engine.kv_cache import SequenceKV
from meshllm.engine.quantized import QuantizedEmbedding
from meshllm.engine.stage_weights import FileEmbedding, load_stage_decoder
from meshllm.errors import ModelLoadError
from meshllm.model.decoder import SeqSlice
from meshllm.model.source import open_model
from tests.quantized_gguf import HIDDEN, write_quantized_llama

pytestmark = pytest.mark.skipif(runtime() is None, reason="ggml is not built here (install.sh builds it)")
PROMPT = [1, 9, 4000, 17, 31000, 250]
PAGE = 4096
# A read fault on a file map maps the whole page-cache folio it hits (up to a PMD, 2 MiB, for a
# file just written, as these are) and up to 64 KiB of cached neighbours (fault_around_bytes).
LARGEST_FOLIO, FAULT_AROUND = 2 << 20, 64 << 10


@pytest.fixture(scope="module")
def files(smollm2_gguf_path, tmp_path_factory):
    """Three GGUFs of one tiny random Llama (SmolLM2's 49152-token vocabulary, 256 wide): a Q8_0
    table and a BF16 one with heads of their own, and a Q8_0 table tied to the head."""
    rt, folder = runtime(), tmp_path_factory.mktemp("mapped")
    return {name: write_quantized_llama(rt, smollm2_gguf_path, folder / f"{name}.gguf", GGML.Q4_0,
                                        embedding_type=table, head_type=head)
            for name, table, head in (("q8_0", GGML.Q8_0, GGML.Q8_0), ("bf16", GGML.BF16, GGML.Q8_0),
                                      ("tied", GGML.Q8_0, None))}


def _load(path, monkeypatch, mapped: bool, dtype=torch.bfloat16, last_layer=None):
    monkeypatch.setenv("MESHLLM_MAP_EMBEDDINGS", "1" if mapped else "0")
    model = open_model(path)
    return load_stage_decoder(model.source, model.config, last_layer=last_layer, dtype=dtype)


def _table_address(decoder) -> int:
    e = decoder.embed_tokens
    return e.table.tensor.contents.data if isinstance(e, QuantizedEmbedding) else e.weight.data_ptr()


def _resident(address: int) -> int:
    """Resident bytes of the memory map holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def _last_logits(decoder, prompt=PROMPT) -> torch.Tensor:
    kv = SequenceKV(decoder.kv_layout(), len(prompt))
    ids = torch.tensor(prompt)
    return decoder(ids, torch.arange(len(prompt)), [SeqSlice(kv, 0, len(prompt))], torch.tensor([len(prompt) - 1]))


@pytest.mark.parametrize("name", ["q8_0", "bf16"])
def test_mapped_table_gives_the_copied_tables_outputs(files, monkeypatch, name):
    mapped, copied = _load(files[name], monkeypatch, True), _load(files[name], monkeypatch, False)
    assert isinstance(mapped.fast_path, GGMLStage)
    if name == "q8_0":
        assert mapped.embed_tokens.table.spans() == [] and copied.embed_tokens.table.spans() != []
    else:
        assert type(mapped.embed_tokens) is FileEmbedding and type(copied.embed_tokens) is torch.nn.Embedding
    assert torch.equal(_last_logits(mapped), _last_logits(copied))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or mmap.PAGESIZE != PAGE,
                    reason="reads Linux's /proc/self/smaps; the folio bound assumes 4 KiB pages")
@pytest.mark.parametrize("name", ["q8_0", "bf16"])
def test_table_rows_become_resident_only_as_they_are_read(files, monkeypatch, name):
    decoder = _load(files[name], monkeypatch, True)
    address = _table_address(decoder)
    table_bytes = decoder.config.vocab_size * HIDDEN * (2 if name == "bf16" else 34 / 32)
    # Nothing read it while loading, and the huge-page collapse of the weights left it alone.
    assert _resident(address) == 0
    _last_logits(decoder, [1, 2, 3, 5, 8, 13])  # rows near the table's start: one folio's worth at most
    touched = _resident(address)
    assert PAGE <= touched <= LARGEST_FOLIO + FAULT_AROUND < table_bytes / 5, (touched, table_bytes)


def test_writes_to_a_mapped_table_never_reach_the_file(files, monkeypatch):
    path = files["bf16"]
    before = path.read_bytes()
    decoder = _load(path, monkeypatch, True)
    assert type(decoder.embed_tokens) is FileEmbedding
    decoder.embed_tokens.weight.data[:4].fill_(1.5)  # copy-on-write: this process's pages only
    assert decoder.embed_tokens.weight[0, 0].item() == 1.5
    assert path.read_bytes() == before


def test_a_table_the_head_shares_is_copied(files, monkeypatch):
    decoder = _load(files["tied"], monkeypatch, True)
    assert decoder.embed_tokens.table.spans() != []  # in a ggml buffer: the head reads all of it
    # A first stage of the same model holds no head: its table is mapped.
    first = _load(files["tied"], monkeypatch, True, last_layer=2)
    assert first.embed_tokens.table.spans() == []


def test_a_file_changed_since_its_header_was_read_is_not_mapped(files, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(files["q8_0"].read_bytes())
    model = open_model(path)
    path.write_bytes(files["bf16"].read_bytes())  # another model at the same path
    with pytest.raises(ModelLoadError, match="changed on disk"):
        model.source.mapped_blocks("model.embed_tokens.weight")


def test_a_dense_table_of_another_dtype_is_converted(files, monkeypatch):
    decoder = _load(files["bf16"], monkeypatch, True, dtype=torch.float32)
    assert type(decoder.embed_tokens) is torch.nn.Embedding and decoder.embed_tokens.weight.dtype == torch.float32
