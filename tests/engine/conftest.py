"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from meshllm.engine.ggml_lib import runtime


@pytest.fixture(scope="module")
def rt():
    """ggml's runtime; the test skips where install.sh could not build it. Modules that need one of
    meshllm's own ops too define their own `rt`, which also skips without it."""
    loaded = runtime()
    if loaded is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    return loaded
