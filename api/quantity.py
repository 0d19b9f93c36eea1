"""Kubernetes quantities (``64Gi``, ``1.5G``, ``512``): parsing, formatting, and the byte-size pattern.

One grammar serves the CRD schema (``BYTES_PATTERN`` becomes the OpenAPI
``pattern`` of every byte-size field, so the API server rejects ``64GB``) and
the Python side (``parse_bytes`` turns the same text into an ``int`` for the
operator and the agent). Keeping both here means the server can never accept a
size the agent cannot read.

``parse_quantity`` follows Kubernetes' ``resource.Quantity`` grammar and, like
``Quantity.Value()``, rounds fractional results up to the next integer.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from daybreak.errors import DaybreakError

# Plain (capturing) groups: these patterns end up in API server error messages, keep them readable.
_NUMBER = r"([0-9]+(\.[0-9]*)?|\.[0-9]+)"
_NUMBER_NC = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"  # the same, non-capturing, for the parser's named groups

# The full Kubernetes grammar (sign, decimal and binary SI suffixes, exponents),
# the same as the pattern Kubernetes publishes for resource.Quantity.
QUANTITY_PATTERN = (
    rf"^[+-]?{_NUMBER}([KMGTPE]i|[numkMGTPE]|[eE][+-]?{_NUMBER})?$"
)

# Byte sizes: no sign, no sub-unit suffixes (m, u, n), a small non-negative
# integer exponent. A subset of QUANTITY_PATTERN, so every accepted value is
# also a valid Kubernetes quantity. The exponent is capped at two digits so a
# manifest cannot ask Python to build a 10**999999 integer.
BYTES_PATTERN = rf"^{_NUMBER}([KMGTPE]i|[kMGTPE]|[eE]\+?[0-9]{{1,2}})?$"

_QUANTITY_RE = re.compile(
    rf"(?P<sign>[+-]?)(?P<number>{_NUMBER_NC})(?:(?P<binary>[KMGTPE]i)|(?P<decimal>[numkMGTPE])|[eE](?P<exp>[+-]?{_NUMBER_NC}))?"
)
_BYTES_RE = re.compile(BYTES_PATTERN)

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 10**3),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9),
    "T": Fraction(10**12), "P": Fraction(10**15), "E": Fraction(10**18),
}
# Guards against pathological exponents in the generic parser (Kubernetes
# itself caps quantities far below this).
_MAX_EXPONENT = 64


class QuantityError(DaybreakError, ValueError):
    """A value that is not a valid Kubernetes quantity (or byte size)."""


def _exact(value: str) -> Fraction:
    match = _QUANTITY_RE.fullmatch(value)
    if match is None:
        raise QuantityError(f"{value!r} is not a Kubernetes quantity (examples: 64Gi, 500M, 1.5Ti, 1024)")
    number = Fraction(match["number"] if not match["number"].endswith(".") else match["number"][:-1])
    if match["binary"]:
        number *= _BINARY[match["binary"]]
    elif match["decimal"]:
        number *= _DECIMAL[match["decimal"]]
    elif match["exp"] is not None:
        exponent = Fraction(match["exp"])
        if exponent.denominator != 1 or abs(exponent) > _MAX_EXPONENT:
            raise QuantityError(f"{value!r}: exponent must be an integer with magnitude <= {_MAX_EXPONENT}")
        number *= Fraction(10) ** int(exponent)
    return -number if match["sign"] == "-" else number


def parse_quantity(value: str | int) -> int:
    """Parse a Kubernetes quantity to an integer, rounding fractions up (``"1.5Ki" -> 1536``, ``"100m" -> 1``)."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is a boolean, not a quantity")
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        raise QuantityError(f"{value!r} is a {type(value).__name__}, not a quantity")
    return math.ceil(_exact(value.strip()))


def parse_bytes(value: str | int) -> int:
    """Parse a non-negative byte size (``"64Gi" -> 68719476736``); strings must match ``BYTES_PATTERN``."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is a boolean, not a byte size")
    if isinstance(value, int):
        if value < 0:
            raise QuantityError(f"byte size must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise QuantityError(f"{value!r} is a {type(value).__name__}, not a byte size")
    if _BYTES_RE.fullmatch(value) is None:
        raise QuantityError(f"{value!r} is not a byte size (examples: 64Gi, 500M, 1.5Ti, 1073741824)")
    return math.ceil(_exact(value))


def format_bytes(value: int) -> str:
    """The shortest exact binary-SI spelling of a byte count (``68719476736 -> "64Gi"``, ``1000 -> "1000"``)."""
    if value < 0:
        raise QuantityError(f"byte size must not be negative, got {value}")
    for suffix, factor in sorted(_BINARY.items(), key=lambda item: -item[1]):
        if value and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)
