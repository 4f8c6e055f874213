"""`meshllm status`: the fleet as one node sees it, as a table or JSON, with the health of
every model a node serves over HTTP (its /health: ok, degraded or unavailable, and why)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from meshllm.cluster.card import Card
from meshllm.cluster.gossip import fetch_view
from meshllm.commands.cluster_key import resolve_key
from meshllm.commands.transport_args import add_transport_arguments, tls_from_args
from meshllm.node import KEY_FILE_NAME, NodeConfig, default_state_dir

_DEFAULT_PEER = f"127.0.0.1:{NodeConfig(state_dir=Path('unused')).port}"
GIB = 1024**3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peer", default=_DEFAULT_PEER, metavar="HOST:PORT",
                        help=f"node to ask (default {_DEFAULT_PEER})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--key-file", type=Path, default=None,
                        help=f"cluster key file (default <state-dir>/{KEY_FILE_NAME})")
    parser.add_argument("--state-dir", type=Path, default=None, help=f"default {default_state_dir()}")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the node (default 5)")
    add_transport_arguments(parser)


def card_json(card: Card, now: float, serving: dict | None = None) -> dict:
    data = dataclasses.asdict(card)
    data["roles"] = [r.value for r in card.roles]
    data["age_seconds"] = round(now - card.announced_at, 3)
    data["serving"] = serving
    return data


def serving_health(api_address: str | None, timeout_s: float = 2.0) -> dict | None:
    """The /health body of a node's HTTP API (None when it serves none); an API that does not
    answer is reported as unreachable rather than failing the whole status."""
    if api_address is None:
        return None
    try:
        with urllib.request.urlopen(f"http://{api_address}/health", timeout=timeout_s) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:  # 503: not ok, and the body says why
        try:
            return json.load(e)
        except ValueError:
            return {"status": "unavailable", "reason": f"HTTP {e.code}"}
    except (OSError, ValueError) as e:
        # urllib wraps the socket error ("<urlopen error [Errno 111] Connection refused>"): its text.
        cause = getattr(e, "reason", e)
        return {"status": "unreachable", "reason": getattr(cause, "strerror", None) or str(cause)}


def describe_serving(serving: dict | None) -> str:
    if serving is None:
        return "-"
    reason = serving.get("reason")
    return serving.get("status", "?") + (f": {reason}" if reason and serving.get("status") != "ok" else "")


def format_table(cards: list[Card], now: float, serving: list[dict | None] | None = None) -> str:
    header = ("NODE", "ADDRESS", "DEVICE", "MEMORY USED/TOTAL", "MODELS", "SHARDS", "AGE", "SERVING")
    rows = [header]
    for c, health in zip(cards, serving or [None] * len(cards)):
        used = (c.memory_total_bytes - c.memory_free_bytes) / GIB
        shards = ", ".join(f"{s.model_id}[{s.first_layer}:{s.last_layer}]" for s in c.shards) or "-"
        rows.append((c.node_id, c.grpc_address, c.device, f"{used:.1f}/{c.memory_total_bytes / GIB:.1f} GiB",
                     ", ".join(m.model_id for m in c.models) or "-", shards, f"{now - c.announced_at:.1f}s",
                     describe_serving(health)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def run(args: argparse.Namespace) -> int:
    key = resolve_key(args.key_file, args.state_dir or default_state_dir(), create=False)
    cards = fetch_view(args.peer, key, args.timeout, tls=tls_from_args(args))
    now = time.time()
    with ThreadPoolExecutor(max_workers=8) as pool:
        serving = list(pool.map(lambda c: serving_health(c.api_address), cards))
    if args.json:
        print(json.dumps({"queried": args.peer, "nodes": [card_json(c, now, h) for c, h in zip(cards, serving)]},
                         indent=2))
    else:
        print(format_table(cards, now, serving))
    return 0
