"""The one device-id codec: ``<uuid>::<n>``.

An MPS or whole-GPU slice is ``GPU-<uuid>::<n>``; a MIG slice is ``MIG-<uuid>::<n>``. This is the
replica form NVIDIA's plugin uses and dcgm-exporter understands, so per-pod GPU metrics keep working.
No other module formats or splits ids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from gpuslice.errors import DeviceIdError

SEPARATOR = "::"
MAX_ID_LENGTH = 63  # kubelet's proto comment on Device.ID
_OWNER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")
#: How many decoded ids :func:`decode` keeps (about 200 bytes each): the ids of the nodes in use now.
DECODED_KEPT = 8192


@dataclass(frozen=True, slots=True, order=True)
class SliceId:
    """One advertised slice: the GPU or MIG instance that owns it and its ordinal there."""

    owner: str
    n: int

    def __str__(self) -> str:
        return encode(self.owner, self.n)


def encode(owner: str, n: int) -> str:
    """Format an id; refuse owners or ordinals that would not decode back to the same pair."""
    if not _OWNER.fullmatch(owner) or SEPARATOR in owner or ":" in owner:
        raise DeviceIdError(f"device owner {owner!r} must be a GPU or MIG UUID without ':'")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise DeviceIdError(f"slice ordinal must be a non-negative integer, got {n!r}")
    text = f"{owner}{SEPARATOR}{n}"
    if len(text) > MAX_ID_LENGTH:
        raise DeviceIdError(f"device id {text!r} is longer than {MAX_ID_LENGTH} characters")
    return text


def encode_all(owner: str, count: int) -> tuple[str, ...]:
    """The ids ``owner::0`` .. ``owner::count-1``, checked once (inventories derive these often)."""
    if count <= 0:
        return ()
    last = encode(owner, count - 1)  # validates the owner and the longest id
    return (*(f"{owner}{SEPARATOR}{n}" for n in range(count - 1)), last)


def decode(text: str) -> SliceId:
    """Split ``<uuid>::<n>``; raise ``DeviceIdError`` saying what is wrong."""
    if not isinstance(text, str):
        raise DeviceIdError(f"device id must be a string, got {type(text).__name__}")
    return _decode(text)


@lru_cache(maxsize=DECODED_KEPT)
def _decode(text: str) -> SliceId:
    """:func:`decode` of a string. Kept for the ids seen last: a node's usage is recomputed from its
    pods' ids on every event there, so the same few thousand ids are split again and again (errors
    are raised, never kept)."""
    if len(text) > MAX_ID_LENGTH:
        raise DeviceIdError(f"device id {text!r} is longer than {MAX_ID_LENGTH} characters")
    owner, sep, index = text.rpartition(SEPARATOR)
    if not sep:
        raise DeviceIdError(f"device id {text!r} is not of the form <uuid>::<n>")
    if not _OWNER.fullmatch(owner) or ":" in owner:
        raise DeviceIdError(f"device id {text!r} has an invalid owner {owner!r}")
    if not _INDEX.fullmatch(index):
        raise DeviceIdError(f"device id {text!r} has an invalid slice ordinal {index!r}")
    return SliceId(owner, int(index))


def owner_of(text: str) -> str:
    """The GPU or MIG UUID an id belongs to."""
    return decode(text).owner
