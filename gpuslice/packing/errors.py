"""Typed errors of the packing engine, rooted in the core's hierarchy so services map them once."""

from __future__ import annotations

from gpuslice.errors import GpuSliceError, PolicyError


class PackingError(GpuSliceError):
    """A cluster state or request the packing engine cannot represent."""


class UnknownPolicyError(PolicyError):
    """A policy name that the registry does not know; ``known`` lists the names it does."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        self.name = name
        self.known = known
        super().__init__(f"unknown policy {name!r}; known policies: {', '.join(known)}")


class WeightError(PolicyError):
    """A policy weight that is negative, not finite, or a combination whose weights sum to zero."""
