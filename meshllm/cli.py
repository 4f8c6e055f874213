"""The one `meshllm` entry point. Each subcommand lives in meshllm/commands/<name>.py
and exposes `add_arguments(parser)` and `run(args) -> int`."""

import argparse
import importlib
import logging
import sys

from meshllm.errors import MeshError

SUBCOMMANDS = {
    "generate": "Generate text from a prompt (locally or through a cluster).",
    "node": "Run a node: gRPC server, gossip, discovery, stage service.",
    "serve": "Run a node that also answers OpenAI-compatible HTTP requests.",
    "status": "Show the fleet as a node sees it.",
    "plan": "Dry-run placement of a model on the fleet.",
    "demo": "Start a whole local cluster serving a real model and ask it something.",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshllm", description="Pool the machines on a desk or LAN into one LLM service.")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"meshllm.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"meshllm.commands.{name}":
                raise
            continue  # subcommand not built yet
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args._run(args)
    except MeshError as e:
        print(f"meshllm {args.command}: error [{e.code}]: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
