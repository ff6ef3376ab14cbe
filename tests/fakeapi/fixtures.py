"""pytest fixtures for the fake API server; import them in a conftest.py:

    from tests.fakeapi.fixtures import fake_api  # noqa: F401
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server import FakeApiServer


@pytest.fixture
def fake_api() -> Iterator[FakeApiServer]:
    """A started server per test, stopped (watches ended, clients closed) afterwards."""
    with FakeApiServer() as server:
        yield server
