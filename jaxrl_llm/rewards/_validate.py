"""Small value checks for reward options, so a bad config value fails when the reward is built."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any


def check_real(name: str, value: Any, *, minimum: float | None = None) -> None:
    """A finite real number (not bool), optionally ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value!r}")


def check_int(name: str, value: Any, *, minimum: int) -> None:
    """An int (not bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be true or false, got {type(value).__name__} {value!r}")


def check_field_name(name: str, value: Any) -> None:
    """A dataset column name: a non-empty string."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"`{name}` must be a non-empty column name, got {value!r}")


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}, got {value!r}")
