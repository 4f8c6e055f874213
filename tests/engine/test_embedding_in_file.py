"""An embedding table no LM head shares stays in the GGUF file, its rows read at each lookup
(gguf.FileRows): the same outputs as a copied table, none of it resident in the process however
many rows are read, and a file truncated under a running stage fails the lookup, not the process."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.engine.ggml_lib import runtime
from meshllm.engine.ggml_stage import GGMLStage
from meshllm.engine.kv_cache import SequenceKV
from meshllm.engine.quantized import FileRowsEmbedding, QuantizedEmbedding
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.errors import ModelLoadError
from meshllm.model.decoder import SeqSlice
from meshllm.model.source import open_model
from tests.quantized_gguf import HIDDEN, write_quantized_llama

pytestmark = pytest.mark.skipif(runtime() is None, reason="ggml is not built here (install.sh builds it)")
PROMPT = [1, 9, 4000, 17, 31000, 250]


@pytest.fixture(scope="module")
def files(smollm2_gguf_path, tmp_path_factory):
    """Three GGUFs of one tiny random Llama (SmolLM2's 49152-token vocabulary, 256 wide): a Q8_0
    table and a BF16 one with heads of their own, and a Q8_0 table tied to the head."""
    rt, folder = runtime(), tmp_path_factory.mktemp("in-file")
    return {name: write_quantized_llama(rt, smollm2_gguf_path, folder / f"{name}.gguf", GGML.Q4_0,
                                        embedding_type=table, head_type=head)
            for name, table, head in (("q8_0", GGML.Q8_0, GGML.Q8_0), ("bf16", GGML.BF16, GGML.Q8_0),
                                      ("tied", GGML.Q8_0, None))}


def _load(path, dtype=torch.bfloat16, last_layer=None):
    model = open_model(path)
    return load_stage_decoder(model.source, model.config, last_layer=last_layer, dtype=dtype)


def _copied(path, dtype=torch.bfloat16):
    """The same stage with its table copied in, as a table the head shares is."""
    model = open_model(path)
    model.source.file_rows = None  # what a source that cannot read rows in place offers
    return load_stage_decoder(model.source, model.config, dtype=dtype)


def _last_logits(decoder, prompt=PROMPT) -> torch.Tensor:
    kv = SequenceKV(decoder.kv_layout(), len(prompt))
    ids = torch.tensor(prompt)
    return decoder(ids, torch.arange(len(prompt)), [SeqSlice(kv, 0, len(prompt))], torch.tensor([len(prompt) - 1]))


def _file_resident(path) -> int:
    """Resident bytes of every map of `path` in this process (/proc/self/smaps)."""
    target, inside, total = str(os.path.realpath(path)), False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and fields[5] == target
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.parametrize("name", ["q8_0", "bf16"])
def test_a_table_in_the_file_gives_the_copied_tables_outputs(files, name):
    in_file, copied = _load(files[name]), _copied(files[name])
    assert isinstance(in_file.fast_path, GGMLStage)
    assert type(in_file.embed_tokens) is FileRowsEmbedding and type(copied.embed_tokens) is not FileRowsEmbedding
    assert list(in_file.embed_tokens.parameters()) == []  # nothing of it held
    assert torch.equal(_last_logits(in_file), _last_logits(copied))
    # The module's own lookup (the path of stages ggml's whole-stage graph does not run) too.
    ids = torch.tensor(PROMPT)
    assert torch.equal(in_file.embed_tokens(ids).float(), copied.embed_tokens(ids).float())


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
@pytest.mark.parametrize("name", ["q8_0", "bf16"])
def test_no_page_of_the_table_becomes_resident_however_many_rows_are_read(files, name):
    """A map of the file made the pages around each row read resident (64 KiB of cached
    neighbours a fault, whole folios of a file just written): 500 random rows of this 13 MiB
    Q8_0 table held most of it."""
    decoder = _load(files[name])
    table_bytes = decoder.config.vocab_size * HIDDEN * (2 if name == "bf16" else 34 / 32)
    ids = random.Random(3).sample(range(decoder.config.vocab_size), 500)
    for start in range(0, 500, 100):
        _last_logits(decoder, ids[start:start + 100])
    decoder.embed_tokens(torch.tensor(ids))
    # What stays mapped of the file is the header the loader reads (metadata, tensor table).
    assert _file_resident(files[name]) < table_bytes / 20, (_file_resident(files[name]), table_bytes)


def test_a_table_the_head_shares_is_copied(files):
    decoder = _load(files["tied"])
    assert isinstance(decoder.embed_tokens, QuantizedEmbedding)  # in a ggml buffer: the head reads all of it
    assert decoder.embed_tokens.table.spans() != []
    # A first stage of the same model holds no head: its table stays in the file.
    first = _load(files["tied"], last_layer=2)
    assert type(first.embed_tokens) is FileRowsEmbedding


def test_a_file_truncated_under_a_running_stage_fails_the_lookup_clearly(files, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(files["q8_0"].read_bytes())
    decoder = _load(path)
    expected = _last_logits(decoder, PROMPT[:3])
    rows = decoder.embed_tokens.rows
    with open(path, "r+b") as f:  # the table's second half gone (a rewrite, a network mount)
        f.truncate(rows.offset + rows.row_bytes * (rows.rows // 2))
    assert torch.equal(_last_logits(decoder, PROMPT[:3]), expected)  # rows still there read as before
    with pytest.raises(ModelLoadError, match="shorter than its header says"):
        _last_logits(decoder, [1, 2, 40000])
    with pytest.raises(ModelLoadError, match="shorter than its header says"):
        decoder.embed_tokens(torch.tensor([40000]))


def test_an_id_outside_the_table_is_refused_by_name(files):
    decoder = _load(files["q8_0"])
    with pytest.raises(IndexError, match="token id 49152 is outside the table's 49152 rows"):
        decoder.embed_tokens.rows.read([5, 49152], np.empty((2, decoder.embed_tokens.rows.row_bytes), np.uint8))


def test_closed_rows_are_never_read_again(files):
    """Once closed, the descriptor's number may be another file's: a read must not reach it."""
    decoder = _load(files["q8_0"])
    rows = decoder.embed_tokens.rows
    rows.close()
    with pytest.raises(ValueError, match="closed"):
        rows.read([5], np.empty((1, rows.row_bytes), np.uint8))


def test_a_file_changed_since_its_header_was_read_is_refused(files, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(files["q8_0"].read_bytes())
    model = open_model(path)
    path.write_bytes(files["bf16"].read_bytes())  # another model at the same path
    with pytest.raises(ModelLoadError, match="changed on disk"):
        model.source.file_rows("model.embed_tokens.weight", torch.bfloat16)


def test_a_dense_table_of_another_dtype_is_converted(files):
    decoder = _load(files["bf16"], dtype=torch.float32)
    assert type(decoder.embed_tokens) is torch.nn.Embedding and decoder.embed_tokens.weight.dtype == torch.float32
