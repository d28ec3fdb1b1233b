"""Argument checks shared by the helper modules, so every error names the argument and what it may be."""

from __future__ import annotations

import math
from typing import Any


def check_positive_int(value: Any, name: str) -> int:
    """Return `value` if it is an `int >= 1`; otherwise raise a `ValueError` naming `name`."""
    # `bool` is an `int` subclass; `True` as a batch size is always a bug, so it is refused.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r} ({type(value).__name__}).")
    return value


def check_positive_float(value: Any, name: str) -> float:
    """Return `value` as a `float` if it is a finite real number > 0; otherwise raise a `ValueError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r} ({type(value).__name__}).")
    return float(value)
