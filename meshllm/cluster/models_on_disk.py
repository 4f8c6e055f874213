"""Find the models a node has on disk (--models) for its capability card.

A model is a Hugging Face folder (config.json + weights) or a .gguf file. A
--models entry may be a model itself or a folder of models (one level deep).
The fingerprint comes from meshllm.model.weights.fingerprint, which hashes the
tensors (and caches the result); until that module exists, or for a model it
cannot read, the model is left out of the card with a warning.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from meshllm.cluster.card import ModelOnDisk
from meshllm.errors import ModelLoadError

log = logging.getLogger(__name__)

Fingerprinter = Callable[[Path], str]


def find_model_paths(entries: Iterable[Path]) -> list[Path]:
    """Model folders and .gguf files named by `entries` or directly inside them."""
    found: list[Path] = []
    for entry in entries:
        if not entry.exists():
            raise ModelLoadError(f"--models {entry} does not exist; pass a model folder, a .gguf file, "
                                 f"or a folder that contains them")
        if _is_model(entry):
            found.append(entry)
        elif entry.is_dir():
            found.extend(child for child in sorted(entry.iterdir()) if _is_model(child))
    return sorted(set(found))


def _is_model(path: Path) -> bool:
    return (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf")


def num_layers(path: Path) -> int:
    """Decoder layer count from config.json or the GGUF header."""
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e
        layers = config.get("num_hidden_layers", config.get("text_config", {}).get("num_hidden_layers"))
    else:
        metadata = read_gguf_metadata(path, stop_when=lambda m: "general.architecture" in m and
                                      f"{m['general.architecture']}.block_count" in m)
        layers = metadata.get(f"{metadata.get('general.architecture')}.block_count")
    if not isinstance(layers, int) or layers < 1:
        raise ModelLoadError(f"{path} does not state a layer count (num_hidden_layers / <arch>.block_count)")
    return layers


# ---------------------------------------------------------------- GGUF header

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: Path, stop_when: Callable[[dict], bool] = lambda m: False) -> dict:
    """Scalar and string key/values of a GGUF header, read only as far as needed.

    (gguf.GGUFReader indexes every tensor and token first: seconds for a small
    model, where this reads a few kilobytes.) Arrays are skipped.
    """
    with path.open("rb") as f:
        def read(fmt: str):
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ModelLoadError(f"{path} ends inside its GGUF header; the file is truncated")
            return struct.unpack(fmt, data)[0]

        file_size = path.stat().st_size

        def read_string() -> str:
            length = read("<Q")
            if length > file_size - f.tell():  # a corrupt length: not terabytes read into memory
                raise ModelLoadError(f"{path} ends inside its GGUF header; the file is truncated or corrupt")
            return f.read(length).decode("utf-8", errors="replace")

        def read_value(kind: int):
            if kind in _GGUF_SCALARS:
                return read(_GGUF_SCALARS[kind])
            if kind == _GGUF_STRING:
                return read_string()
            if kind == _GGUF_ARRAY:
                item_kind, count = read("<I"), read("<Q")
                if item_kind in _GGUF_SCALARS:
                    f.seek(struct.calcsize(_GGUF_SCALARS[item_kind]) * count, 1)
                else:  # strings (and nested arrays) carry their own lengths: skip one by one
                    for _ in range(count):
                        read_value(item_kind)
                return None
            raise ModelLoadError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic)")
        read("<I")  # version
        read("<Q")  # tensor count
        metadata: dict = {}
        for _ in range(read("<Q")):
            key = read_string()
            value = read_value(read("<I"))
            if value is not None:
                metadata[key] = value
            if stop_when(metadata):
                break
        return metadata


# ---------------------------------------------------------------- fingerprints

def default_fingerprinter() -> Fingerprinter | None:
    """meshllm.model.weights.fingerprint, or None while that module is not built."""
    try:
        from meshllm.model import weights
    except ModuleNotFoundError as e:
        if e.name != "meshllm.model.weights":
            raise
        return None
    return getattr(weights, "fingerprint", None)


def describe(path: Path, fingerprint: Fingerprinter) -> ModelOnDisk:
    model_id = path.stem if path.is_file() else path.name
    return ModelOnDisk(model_id=model_id, fingerprint=fingerprint(path), num_layers=num_layers(path),
                       path=str(path))


class ModelScan:
    """Describes the models under --models on a background thread, so a node
    answers gossip while first-time fingerprints of big models are computed.
    `models` is () until the scan ends."""

    def __init__(self, entries: Iterable[Path], fingerprint: Fingerprinter | None = None):
        self._paths = find_model_paths(entries)  # a bad --models path fails at start-up
        self._fingerprint = fingerprint
        self._models: tuple[ModelOnDisk, ...] = ()
        self._thread = threading.Thread(target=self._scan, name="model-scan", daemon=True)
        self.done = threading.Event()

    @property
    def models(self) -> tuple[ModelOnDisk, ...]:
        return self._models

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        pass  # the daemon thread only reads files; nothing to release

    def _scan(self) -> None:
        try:
            fingerprint = self._fingerprint or default_fingerprinter()
            if fingerprint is None:
                if self._paths:
                    log.warning("meshllm.model.weights.fingerprint is not available: %d model(s) under --models "
                                "are left out of this node's card", len(self._paths))
                return
            models = []
            for path in self._paths:
                try:
                    models.append(describe(path, fingerprint))
                except Exception as e:  # noqa: BLE001 - one bad file (a header claiming terabytes: MemoryError,
                    # ValueError) must not end the scan and take every good model off the card
                    log.warning("leaving %s out of this node's card: %s: %s", path, type(e).__name__, e)
            self._models = tuple(models)
            log.info("found %d model(s) on disk", len(models))
        finally:
            self.done.set()
