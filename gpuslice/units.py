"""Kubernetes quantities and memory units.

Pods write memory as Kubernetes quantities (``20Gi``, ``40G``, ``1.5Ti``); the catalogue keeps MiB.
Parsing is exact (``Fraction``) so that ``0.5Gi`` is 512 MiB, not a float near it.
"""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction

from gpuslice.errors import RequestError

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1),
            "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
            "P": Fraction(10**15), "E": Fraction(10**18)}
_QUANTITY = re.compile(
    r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?")
# Kubernetes quantities fit in an int64 of nano-units; these bounds refuse absurd input before any
# arithmetic, so a user-written annotation cannot make the parser spin.
MAX_DIGITS = 40
MAX_EXPONENT = 30

MIB = 2**20


def _show(value: object) -> str:
    """The value for an error message, cut short: a message must not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= 48 else text[:45] + "..."


def parse_quantity(value: object, *, what: str) -> Fraction:
    """Parse a Kubernetes quantity (string or number) exactly; ``what`` names it in errors."""
    if isinstance(value, bool):
        raise RequestError(f"{what}: expected a quantity, got a boolean")
    if isinstance(value, int):
        if abs(value) >= 10**MAX_DIGITS:
            raise RequestError(f"{what}: {_show(value)} is out of range for a Kubernetes quantity")
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RequestError(f"{what}: {value!r} is not a finite quantity")
        if abs(value) >= 10.0**MAX_DIGITS:
            raise RequestError(f"{what}: {_show(value)} is out of range for a Kubernetes quantity")
        return Fraction(str(value))
    if not isinstance(value, str):
        raise RequestError(f"{what}: expected a quantity such as '2' or '20Gi', got {type(value).__name__}")
    if len(value) <= 64:  # the usual case: a few distinct strings ("4", "32Gi") over many pods
        cached = _parse_text(value)
        if isinstance(cached, Fraction):
            return cached
        raise RequestError(f"{what}: {_show(value)} {cached}")
    result = _parse_uncached(value)
    if isinstance(result, str):
        raise RequestError(f"{what}: {_show(value)} {result}")
    return result


@functools.lru_cache(maxsize=4096)
def _parse_text(value: str) -> Fraction | str:
    """A quantity string's value, or why it is not one (Fractions are immutable: safe to share)."""
    return _parse_uncached(value)


def _parse_uncached(value: str) -> Fraction | str:
    text = value.strip()
    match = _QUANTITY.fullmatch(text)
    if match is None:
        return "is not a Kubernetes quantity"
    sign, number, exponent, suffix = match.groups()
    if len(number) > MAX_DIGITS or (exponent is not None and abs(int(exponent[:MAX_DIGITS])) > MAX_EXPONENT):
        return "is out of range for a Kubernetes quantity"
    amount = Fraction(number)
    if exponent is not None:
        amount *= Fraction(10) ** int(exponent)
    elif suffix in _BINARY:
        amount *= _BINARY[suffix]
    else:
        amount *= _DECIMAL[suffix or ""]
    return -amount if sign == "-" else amount


def quantity_to_mib(value: object, *, what: str) -> Fraction:
    """A byte quantity as exact MiB."""
    return parse_quantity(value, what=what) / MIB


def format_mib(mib: float) -> str:
    """Human-readable GiB for messages (``19.62 GiB``)."""
    return f"{mib / 1024:.2f} GiB"
