"""Argument checks for the public functions: each bad argument is a
``TypeError`` (the wrong kind of value) or a ``vmmbuf.errors`` exception
that is also a ``ValueError`` (a value out of range), with a message in the
caller's words (names, sizes in KiB/MiB/GiB), never a bare error from deeper
down."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any, List, Optional

from .errors import InvalidArgumentError

#: The most bytes any one range may span: 2**63 - 1 (no address space is
#: larger; sizes past it overflow the drivers' offsets).
MAX_BYTES = (1 << 63) - 1

#: The most a limit or budget may name (the native layer's size type):
#: 2**64 - 1 stands for "no limit".
MAX_LIMIT = (1 << 64) - 1


def size(n: int) -> str:
    """``n`` bytes as a person reads them: "512 bytes", "1.5 MiB", "80 GiB"."""
    if n < 1024:
        return f"{n} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        n /= 1024  # type: ignore[assignment]
        if n < 1024 or unit == "EiB":
            text = f"{n:.1f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    raise AssertionError("unreachable")


def integer(name: str, value: Any, *, minimum: int = 0, maximum: Optional[int] = None) -> int:
    """``value`` as an int (an int or anything with ``__index__``, such as a
    NumPy integer; never a bool, a float or a string), within bounds."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, not a bool ({value!r})")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, not {type(value).__name__} ({value!r})"
        ) from None
    if n < minimum:
        raise InvalidArgumentError(f"{name} is {n}: it must be at least {minimum}")
    if maximum is not None and n > maximum:
        raise InvalidArgumentError(f"{name} is {n}: it must be at most {maximum}")
    return n


def flag(name: str, value: Any) -> bool:
    """A bool argument (True or False, nothing else)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {value!r}")
    return value


def tag(name: str, value: Any) -> str:
    """A tag: a string, or None for the default tag ("")."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string or None, not {type(value).__name__} ({value!r})")
    if "\0" in value:
        raise InvalidArgumentError(f"{name} {value!r} holds a NUL character")
    return value


def tags(value: Any) -> List[Optional[str]]:
    """Tags to act on: None (every tag), a tag, or an iterable of tags."""
    if value is None:
        return [None]
    if isinstance(value, str):
        return [tag("tag", value)]
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, Iterable):
        raise TypeError(
            f"tags must be None, a string or a list of strings, not {type(value).__name__} ({value!r})"
        )
    return [tag("each tag", t) for t in value]


def device(value: Any, count: int) -> int:
    """A CUDA device ordinal that exists here (``count`` devices; with none,
    only 0 is accepted, and it names nothing yet)."""
    n = integer("device", value)
    if count == 0 and n != 0:
        raise InvalidArgumentError(f"device {n}: this machine has no CUDA device")
    if count > 0 and n >= count:
        raise InvalidArgumentError(
            f"device {n}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
            f"(0 to {count - 1})"
        )
    return n
