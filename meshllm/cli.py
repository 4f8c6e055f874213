"""The one `meshllm` entry point. Each subcommand lives in meshllm/commands/<name>.py
and exposes `add_arguments(parser)` and `run(args) -> int`."""

import argparse
import importlib
import logging
import os
import sys

# gRPC's own log lines (an INFO line per refused TLS handshake, every few seconds while a node with
# another key retries) say less than the errors meshllm raises for them; before grpc is imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from meshllm.engine.host_memory import return_large_frees
from meshllm.errors import MeshError

SUBCOMMANDS = {
    "generate": "Generate text from a prompt (locally or through a cluster).",
    "node": "Run a node: gRPC server, gossip, discovery, stage service.",
    "serve": "Run a node that also answers OpenAI-compatible HTTP requests.",
    "status": "Show the fleet as a node sees it.",
    "plan": "Dry-run placement of a model on the fleet.",
    "demo": "Start a whole local cluster serving a real model and ask it something.",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI parser. Only `command`'s module is imported (they pull in torch, grpc, ...),
    so `meshllm status` starts in a fraction of the time `meshllm generate` needs."""
    parser = argparse.ArgumentParser(prog="meshllm", description="Pool the machines on a desk or LAN into one LLM service.")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="Python logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(f"meshllm.commands.{name}")
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in SUBCOMMANDS), None)
    args = build_parser(command).parse_args(argv)
    return_large_frees()  # before the first large allocation (host_memory says why)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args._run(args)
    except MeshError as e:
        print(f"meshllm {args.command}: error [{e.code}]: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
