"""Runs the API app under uvicorn on a background thread, as a node Service (start/stop).

The socket is bound before anything else (`listen`, or the constructor), so a taken port
fails at once with BindFailed and `port` is known before start (port 0 picks a free one).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from meshllm.errors import BindFailed

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


def listen(host: str, port: int, port_flag: str = "--api-port") -> socket.socket:
    """The API's socket, bound: a command binds it first, before it starts nodes or loads weights
    that a taken port would leave behind. `port_flag` names the command's option in the error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise BindFailed(f"the HTTP API cannot listen on {host}:{port}: {e.strerror}; pick another "
                         f"{port_flag} or stop what uses it") from None
    return sock


class APIServer:
    def __init__(self, app: FastAPI, host: str, port: int, sock: socket.socket | None = None):
        """`sock`: bound by `listen` already (else bound here)."""
        self._socket = sock if sock is not None else listen(host, port)
        self.host = host
        self.port = self._socket.getsockname()[1]
        # Our own logging config stays in charge: uvicorn logs through the standard loggers.
        self._server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False,
                                                     timeout_graceful_shutdown=2))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="http-api")
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive():
                raise BindFailed(f"the HTTP API on {self.url} stopped while starting; see the log above")
            if time.monotonic() > deadline:
                raise BindFailed(f"the HTTP API on {self.url} did not start within {_START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        log.info("HTTP API listening on %s", self.url)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._socket]))

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=_STOP_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("HTTP API thread did not stop within %.0f s", _STOP_TIMEOUT_S)
        self._socket.close()
