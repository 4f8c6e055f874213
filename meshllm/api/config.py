"""Settings of the HTTP API; the CLI builds this, and each default lives here."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any

from meshllm.api.schemas import checked_template_kwargs

API_KEY_ENV = "MESHLLM_API_KEY"
MIB = 1024 * 1024


def api_key_from(flag: str | None) -> str | None:
    """The API key a serving command uses: its --api-key, else $MESHLLM_API_KEY, else none."""
    return flag if flag is not None else os.environ.get(API_KEY_ENV) or None


def add_api_guard_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every command that serves the API takes (serve, demo)."""
    parser.add_argument("--api-key", default=None,
                        help=f"key clients must send as 'Authorization: Bearer <key>' for everything but /health "
                             f"and /metrics (default: ${API_KEY_ENV}, or no key when that is unset)")
    default_mib = APIConfig().max_body_bytes / MIB
    parser.add_argument("--max-body-mib", type=float, default=default_mib,
                        help=f"largest request body in MiB, refused unread above (default {default_mib:g})")
    parser.add_argument("--chat-template-kwargs", type=_json_object, default={}, metavar="JSON",
                        help="variables for the model's chat template in every chat request, under the "
                             "request's own chat_template_kwargs, e.g. '{\"enable_thinking\": false}' (Qwen3, "
                             "SmolLM3: no reasoning)")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class APIConfig:
    host: str = "127.0.0.1"  # 0.0.0.0 serves the LAN
    port: int = 8000  # 0 picks a free port
    api_key: str | None = None  # None: no key needed; else clients send "Authorization: Bearer <key>"
    request_timeout_s: float = 600.0  # a request still running after this is cancelled
    # Bodies over this are refused unread (413). 8 MiB holds ~2M characters of prompt, far more
    # than any served context; token-id prompts take ~6 bytes a token.
    max_body_bytes: int = 8 * MIB
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # under each request's own

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--api-port must be in [0, 65535], got {self.port}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be positive seconds, got {self.request_timeout_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-mib must allow at least 1 KiB, got {self.max_body_bytes} bytes")
        checked_template_kwargs(self.chat_template_kwargs)  # ValueError names the variable
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty; give a key or leave the flag out to serve without one")
