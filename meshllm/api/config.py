"""Settings of the HTTP API; the CLI builds this, and each default lives here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class APIConfig:
    host: str = "127.0.0.1"  # 0.0.0.0 serves the LAN
    port: int = 8000  # 0 picks a free port
    api_key: str | None = None  # None: no key needed; else clients send "Authorization: Bearer <key>"
    request_timeout_s: float = 600.0  # a request still running after this is cancelled

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--api-port must be in [0, 65535], got {self.port}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be positive seconds, got {self.request_timeout_s}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty; give a key or leave the flag out to serve without one")
