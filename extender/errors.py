"""The extender's typed errors, so the HTTP layer and the CLI translate them by class, not by message.

    ExtenderError
    ├── WireError      a request body kube-scheduler's extender protocol does not allow (HTTP 400)
    └── KubeApiError   a Kubernetes API call failed, with the status code when there was one

Other modules of the extender may append classes here.
"""

from __future__ import annotations

from gpuslice.errors import GpuSliceError


class ExtenderError(GpuSliceError):
    """Base of every error raised by ``extender``."""


class WireError(ExtenderError):
    """A malformed extender request or response; ``field`` is the JSON path at fault, when known.

    The message is meant for an operator reading the scheduler's log, so it names the field and what
    was expected instead of echoing the (possibly huge or hostile) value.
    """

    def __init__(self, reason: str, field: str | None = None) -> None:
        self.reason = reason
        self.field = field
        super().__init__(f"{field}: {reason}" if field else reason)


class KubeApiError(ExtenderError):
    """A Kubernetes API call failed; ``status`` is the HTTP code (None for transport errors)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)
