"""Regenerate the committed *_pb2.py / *_pb2_grpc.py stubs from every .proto here.

    python -m meshllm.transport.protos.generate

The stubs are committed so a plain install needs no protoc; the test
tests/transport/test_protos.py regenerates into a temporary folder and fails
when the committed files differ, naming this command as the fix.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTOS_DIR = Path(__file__).resolve().parent

# protoc writes `import cluster_pb2 as cluster__pb2`, which only works when the
# folder is on sys.path; inside the package the stubs must import each other
# relative to it.
_TOP_LEVEL_STUB_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def proto_files(protos_dir: Path = PROTOS_DIR) -> list[Path]:
    return sorted(protos_dir.glob("*.proto"))


def generate(out_dir: Path, protos_dir: Path = PROTOS_DIR) -> list[Path]:
    """Run protoc on every .proto in `protos_dir`, writing fixed-up stubs to `out_dir`.

    Returns the written stub paths, sorted.
    """
    from grpc_tools import protoc  # build-time dependency only

    sources = proto_files(protos_dir)
    if not sources:
        raise FileNotFoundError(f"no .proto files in {protos_dir}")
    with tempfile.TemporaryDirectory() as raw_dir:
        include = Path(protoc.__file__).resolve().parent / "_proto"
        argv = [
            "grpc_tools.protoc",
            f"-I{protos_dir}",
            f"-I{include}",
            f"--python_out={raw_dir}",
            f"--grpc_python_out={raw_dir}",
            *(str(p) for p in sources),
        ]
        if protoc.main(argv) != 0:
            raise RuntimeError(f"protoc failed on {[p.name for p in sources]}; see its output above")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for stub in sorted(Path(raw_dir).glob("*_pb2*.py")):
            text = _TOP_LEVEL_STUB_IMPORT.sub(r"from . import \1 as \2", stub.read_text())
            target = out_dir / stub.name
            target.write_text(text)
            written.append(target)
    return written


def main() -> int:
    for path in generate(PROTOS_DIR):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
