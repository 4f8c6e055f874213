"""The cluster key a command uses, from --key-file or the state directory (its own module: `status`
reads the key without importing the node command's stage service, and torch with it)."""

from __future__ import annotations

from pathlib import Path

from meshllm.node import KEY_FILE_NAME
from meshllm.transport.auth import load_key, load_or_create_key


def resolve_key(key_file: Path | None, state_dir: Path, *, create: bool) -> bytes:
    """The cluster key. A node without --key-file creates one on first start and
    says how to share it; other commands only read it."""
    path = key_file or state_dir / KEY_FILE_NAME
    if key_file is not None or not create:
        return load_key(path)
    key, created = load_or_create_key(path)
    if created:
        print(f"meshllm: generated a new cluster key in {path}\n"
              f"meshllm: every node of this cluster needs it: copy the file to the other machines and start "
              f"them with --key-file <copied file>", flush=True)
    return key
