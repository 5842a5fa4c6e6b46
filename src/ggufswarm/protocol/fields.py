"""Checked fields of a JSON request body: ``json_field(body, "max_length", int)``, not a hand-written test per field."""

from __future__ import annotations

import sys

from .errors import ProtocolError

REQUIRED = object()  # ``json_field``'s default for a field the body must have
_FLOAT_MAX = sys.float_info.max


def _shown(value) -> str:
    """``value`` as a message shows it: its repr, cut to 100 characters (a body may hold a huge string or number)."""
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _bound(x) -> str:
    """A bound as a message shows it: ``2**63 - 1`` rather than its 19 digits."""
    if isinstance(x, int) and x > 2**32 and (x + 1) & x == 0:
        return f"2**{x.bit_length()} - 1"
    return str(x)


def json_field(
    body: dict, name: str, kind: type, default=REQUIRED, *, min=None, max=None, positive: bool = False, unit: str = ""
):
    """``body[name]`` checked: ``kind`` ``int`` (a JSON integer; ``true``/``false`` are not integers, nor is
    ``1.0``), ``bool`` (``true`` or ``false``; never 0 or 1) or ``float`` (a finite JSON number, integer or not,
    never a bool; returned as a float). ``min`` / ``max``: inclusive bounds; ``positive``: more than 0;
    ``unit``: what the number counts, for messages (``"seconds"``).

    A missing field gives ``default``, and so does ``null`` when ``default`` is None; with no default the field
    is required. Raises ProtocolError("bad_request") naming the field, what it must be, and what it got.
    """
    value = body.get(name, REQUIRED)
    if value is REQUIRED or (value is None and default is None):
        if default is REQUIRED:
            raise ProtocolError(
                "bad_request", f"{name} must be {_wanted(kind, min, max, positive, unit)}; the body has no {name}"
            )
        return default
    if kind is bool:
        ok = isinstance(value, bool)
    else:  # a bool is an int in Python, not in JSON; a float is finite (compared, not converted: 10**400 is refused)
        ok = (
            not isinstance(value, bool)
            and isinstance(value, int if kind is int else (int, float))
            and (kind is int or -_FLOAT_MAX <= value <= _FLOAT_MAX)
            and (not positive or value > 0)
            and (min is None or value >= min)
            and (max is None or value <= max)
        )
    if not ok:
        raise ProtocolError(
            "bad_request", f"{name} must be {_wanted(kind, min, max, positive, unit)}, got {_shown(value)}"
        )
    return float(value) if kind is float else value


def _wanted(kind: type, lo, hi, positive: bool, unit: str) -> str:
    """What a field must be, in words: "an integer in 0..20", "a positive finite number of seconds", ..."""
    if kind is bool:
        return "true or false"
    noun = "integer" if kind is int else "finite number"
    text = f"a positive {noun}" if positive else f"an {noun}" if kind is int else f"a {noun}"
    if unit:
        text += f" of {unit}"
    if lo is not None and hi is not None:
        text += f" in {_bound(lo)}..{_bound(hi)}"
    elif lo is not None:
        text += f" >= {_bound(lo)}"
    elif hi is not None:
        text += f" <= {_bound(hi)}"
    return text
