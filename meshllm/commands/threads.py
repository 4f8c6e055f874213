"""`--threads`: how many CPU threads a process computes with (ggml's pool; torch's where ggml does
not run). Set before anything loads: the first ggml pool takes torch's count at that moment
(engine/ggml_lib.py), and a node's card advertises the speed measured with it."""

from __future__ import annotations

import argparse

from meshllm.errors import BadRequest


def add_threads_argument(parser: argparse.ArgumentParser, default: str = "one per core, or OMP_NUM_THREADS") -> None:
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help=f"CPU threads that compute (ggml's pool, or torch's where ggml does not run; "
                             f"default: {default})")


def apply_threads(threads: int | None) -> None:
    """Use `threads` compute threads in this process (None: leave the default)."""
    if threads is None:
        return
    if threads < 1:
        raise BadRequest(f"--threads must be at least 1, got {threads}")
    import torch  # not at import: `status` and `plan` parse these flags too, and start fast

    torch.set_num_threads(threads)
