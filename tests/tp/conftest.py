"""Fixtures shared by the tensor-parallel tests."""

from __future__ import annotations

import pytest

from meshllm.tp.group import StoreHost


@pytest.fixture
def store():
    """A rendezvous store on loopback, as a node with --collective-port hosts one."""
    host = StoreHost("127.0.0.1")
    host.start()
    yield host
    host.stop()
