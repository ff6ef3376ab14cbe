"""The core's typed errors.

Every error a caller can act on has its own class, so the services translate them at their edges
(HTTP 4xx, gRPC status, CLI exit code) without parsing messages::

    GpuSliceError
    ├── CatalogueError        unknown product or MIG profile
    ├── DeviceIdError         a device id that is not ``<uuid>::<n>``
    ├── InventoryError        an inventory operation on ids that are unknown or in the wrong state
    ├── RequestError          a pod whose slice request cannot be honoured as written
    ├── AnnotationError       a malformed or unsupported contract annotation
    ├── ConfigError           a config file that fails validation (carries field paths)
    ├── PolicyError           an unknown policy name or bad weight
    └── AdviceError           a measured peak the right-sizing rule cannot use
"""

from __future__ import annotations


class GpuSliceError(Exception):
    """Base of every error raised by ``gpuslice``."""


class CatalogueError(GpuSliceError):
    """A product or MIG profile that the catalogue does not know."""


class DeviceIdError(GpuSliceError):
    """A device id that does not follow ``<uuid>::<n>``."""


class InventoryError(GpuSliceError):
    """An allocation or release that does not fit the inventory."""


class RequestError(GpuSliceError):
    """A pod's slice request that is malformed or cannot be honoured in this version."""


class AnnotationError(GpuSliceError):
    """A contract annotation that is malformed, of an unknown version, or for another pod."""


class ConfigError(GpuSliceError):
    """A config that fails validation; ``errors`` holds ``(field path, message)`` pairs."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = errors
        lines = "; ".join(f"{path}: {msg}" if path else msg for path, msg in errors)
        super().__init__(f"invalid config: {lines}")


class PolicyError(GpuSliceError):
    """An unknown policy name or an invalid weight."""


class AdviceError(GpuSliceError):
    """A measured figure the right-sizing rule cannot use (negative, not a number, a ratio over 1)."""
