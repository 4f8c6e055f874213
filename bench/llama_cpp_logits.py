"""Logits of tiny random models of each family, meshllm against llama.cpp's own, on the same GGUF.

tests/ check each family against transformers on its folder, and a GGUF conversion (written as
llama.cpp's converter writes one) against that folder. This checks the last link: that meshllm
reads such a file as llama.cpp computes it (metadata defaults, names, rope, routing). Each tiny
model (tests/conftest.py) is converted by the tests' writer, given a stand-in vocabulary
llama.cpp accepts, and run by a small program linked against the cached llama.cpp build
(bench/llama_cpp.py; built on first use, ~15 min) on 16 token ids; meshllm runs the same file
on its torch path and on ggml's. Prints one JSON object: per family the logits' spread and the
largest difference of each path from llama.cpp's (llama.cpp keeps its KV cache in f16: ~1e-3
of the spread is rounding), and whether the argmax agrees everywhere.

Two differences are meshllm's choice, where llama.cpp departs from the model's reference
(transformers, which tests/ match): GPT-OSS's YaRN ramp, whose ends llama.cpp rounds to whole
dims (the torch path is also run that way, `torch_rounded_yarn_max_diff`, to show it is the only
one), and Phi-3's sliding window, which llama.cpp does not apply (the window-free partial-rotary
Phi-3 runs here; the windowed one differs once a prompt passes its window).

    flock -x /work/cpu.lock python bench/llama_cpp_logits.py [--families glm4-moe:glm4moe,gemma2:gemma2]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp  # noqa: E402  (bench/llama_cpp.py)

# tiny variant (tests/conftest.py) : GGUF architecture
FAMILIES = ["llama:llama", "qwen3:qwen3", "phi3-partial:phi3", "phi3-longrope:phi3", "gemma2:gemma2",
            "gemma3:gemma3", "glm4:glm4", "qwen3-moe:qwen3moe", "gpt-oss:gpt-oss", "glm4-moe:glm4moe",
            "minimax-m2:minimax-m2", "qwen2-moe:qwen2moe"]
IDS = [5, 9, 2, 7, 11, 3, 8, 40, 41, 42, 43, 44, 60, 61, 17, 18]
VOCAB = 96  # the tiny models' (tests/conftest.py _COMMON)

DUMP = r"""
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <vector>
// dump-logits MODEL OUT N_VOCAB N_CTX ID...: every position's logits, float32 [ids, vocab]
int main(int argc, char ** argv) {
    if (argc < 6) return 2;
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) return 1;
    int n_vocab = atoi(argv[3]);
    std::vector<llama_token> ids;
    for (int i = 5; i < argc; i++) ids.push_back(atoi(argv[i]));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = atoi(argv[4]);
    cp.n_batch = cp.n_ubatch = ids.size();
    cp.n_threads = cp.n_threads_batch = 2;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;
    llama_batch batch = llama_batch_init(ids.size(), 0, 1);
    for (size_t i = 0; i < ids.size(); i++) {
        batch.token[i] = ids[i]; batch.pos[i] = i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = 1;
    }
    batch.n_tokens = ids.size();
    if (llama_decode(ctx, batch) != 0) return 1;
    FILE * f = fopen(argv[2], "wb");
    for (size_t i = 0; i < ids.size(); i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, f);
    fclose(f);
    return 0;
}
"""


def dump_logits_tool() -> Path:
    """The program above, linked against the cached llama.cpp build (built once)."""
    build = llama_cpp.tools().parent
    src = llama_cpp.ROOT / f"src-{llama_cpp.LLAMA_CPP_PYTHON}"
    out = build / "bin" / "dump-logits-v2"  # v2: the context length an argument
    if not out.exists():
        source = build / "dump_logits.cpp"
        source.write_text(DUMP)
        libs = [build / "src" / "libllama.a", *(build / "ggml" / "src" / f"lib{n}.a" for n in ("ggml", "ggml-cpu",
                                                                                              "ggml-base"))]
        rpc = build / "ggml" / "src" / "ggml-rpc" / "libggml-rpc.a"
        libs += [rpc] if rpc.exists() else []
        includes = [f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}"]
        subprocess.run(["g++", "-O2", "-std=c++17", str(source), *includes, "-o", str(out), *map(str, libs),
                        "-lpthread", "-fopenmp"], check=True)
    return out


def write_gguf(variant: str, arch: str, folder: Path) -> Path:
    """The tiny `variant` as the tests' converter writes it, plus a vocabulary llama.cpp loads."""
    import tests.model.test_gguf as writer
    from tests.conftest import TINY_VARIANTS, _build_tiny_model

    finish = writer._finish

    def with_vocabulary(w) -> None:  # 96 stand-in tokens (ids are given, never text) and one merge
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([f"<{i}>" for i in range(VOCAB)])
        w.add_token_types([1] * VOCAB)
        w.add_token_merges(["< 0"])
        finish(w)

    # llama.cpp takes head_dim for Gemma's query scale and GPT-OSS's SwiGLU limit of 7: as a GGUF has
    # them. LongRoPE: llama.cpp pads its context to 256 positions, past the tiny model's original
    # 32, and so takes the long factors; here they are the short ones, so both run the same.
    overrides = {"gemma2": {"query_pre_attn_scalar": 16}, "gemma3": {"query_pre_attn_scalar": 16},
                 "gpt-oss": {"swiglu_limit": 7.0}}.get(variant, {})
    rope = TINY_VARIANTS[variant][1].get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":
        overrides = {"rope_parameters": {**rope, "long_factor": rope["short_factor"]}}
    _build_tiny_model(variant, folder / "hf", 0, None, **overrides)
    writer._finish = with_vocabulary
    try:
        return writer.write_model_gguf(folder / "hf", folder / "model.gguf", arch)
    finally:
        writer._finish = finish


def compare(variant: str, arch: str, tool: Path) -> dict:
    from meshllm.engine.stage_weights import load_stage_decoder
    from meshllm.model.gguf import GGUFSource
    from meshllm.model.config import YarnScaling
    from meshllm.model.loader import load_decoder

    with tempfile.TemporaryDirectory() as tmp:
        path = write_gguf(variant, arch, Path(tmp))
        out = Path(tmp) / "logits.f32"
        # the context no longer than the model's: llama.cpp picks LongRoPE's long factors for a
        # longer one, where meshllm stops at the original context (model/config.py says why)
        context = min(256, GGUFSource(path).config().max_position_embeddings)
        subprocess.run([str(tool), str(path), str(out), str(VOCAB), str(context), *map(str, IDS)], check=True,
                       capture_output=True)
        theirs = torch.from_numpy(np.fromfile(out, dtype=np.float32).reshape(len(IDS), VOCAB))
        source = GGUFSource(path)
        config, ids = source.config(), torch.tensor(IDS)
        paths = {"torch": load_decoder(source, config).forward_full(ids),
                 "ggml": load_stage_decoder(source, config).forward_full(ids)}
        if isinstance(config.rope_scaling, YarnScaling) and not config.rope_scaling.truncate:
            rounded = replace(config, rope_scaling=replace(config.rope_scaling, truncate=True))
            paths["torch_rounded_yarn"] = load_decoder(source, rounded).forward_full(ids)
    result = {"spread": round((theirs.max() - theirs.min()).item(), 3)}
    for name, ours in paths.items():
        result[f"{name}_max_diff"] = float(f"{(ours - theirs).abs().max().item():.2e}")
        differ = ours.argmax(-1) != theirs.argmax(-1)
        result[f"{name}_argmax_agrees"] = not bool(differ.any())
        if differ.any():  # near-ties: how far apart llama.cpp's own logits put the two choices there
            rows = differ.nonzero().flatten()
            gaps = theirs[rows].max(-1).values - theirs[rows, ours[rows].argmax(-1)]
            result[f"{name}_argmax_differs_at"] = {"rows": rows.tolist(), "llama_cpp_gap": float(f"{gaps.max():.2e}")}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="variant:arch,...")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tool = dump_logits_tool()
    results = {}
    for family in args.families.split(","):
        variant, arch = family.split(":")
        try:
            results[variant] = compare(variant, arch, tool)
        except subprocess.CalledProcessError as e:  # llama.cpp refused the file: say so, go on
            results[variant] = {"llama_cpp_failed": (e.stderr or b"").decode(errors="replace")[-300:]}
        print(variant, results[variant], file=sys.stderr)
    print(json.dumps({"llama_cpp": llama_cpp.LLAMA_CPP_PYTHON, "ids": len(IDS), "families": results}, indent=1))


if __name__ == "__main__":
    main()
