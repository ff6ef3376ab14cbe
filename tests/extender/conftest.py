"""Shared fixtures for the extender tests: the in-process fake API server."""

from tests.fakeapi.fixtures import fake_api  # noqa: F401
