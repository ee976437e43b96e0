"""The one error type cost_models raises on purpose, and the root of the project's errors.

``cost_models`` never imports ``autopar``, so the root class every deliberate error of the
project derives from, :class:`AutoparError`, is defined here and re-exported by
``autopar.errors``: a user's ``except autopar.AutoparError`` also catches a cluster
described with impossible numbers (``Cluster.preset("dgx-h100", nodes=0)``), and
:class:`CostModelError` stays a ``ValueError`` for code that catches that.
"""

from __future__ import annotations

from collections.abc import Iterable


class AutoparError(Exception):
    """Base class of every error autopar (the compiler and its cost models) raises on
    purpose; ``autopar.AutoparError`` is this class."""


class CostModelError(AutoparError, ValueError):
    """An input to a cost model was invalid; the message says what and lists allowed values."""


def check_choice(what: str, value: object, allowed: Iterable[object]) -> None:
    """Raise :class:`CostModelError` unless ``value`` is one of ``allowed``.

    Example:
        >>> check_choice("schedule", "1f1b", ("gpipe", "1f1b"))
    """
    allowed = tuple(allowed)
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise CostModelError(f"{what} must be one of {choices}; got {value!r}")


def check_positive(what: str, value: float, *, allow_zero: bool = False) -> None:
    """Raise :class:`CostModelError` unless ``value`` is a positive (or non-negative) number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CostModelError(f"{what} must be a number; got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise CostModelError(f"{what} must be finite; got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise CostModelError(f"{what} must be {bound}; got {value!r}")


def check_int(what: str, value: object, *, minimum: int = 1) -> int:
    """Return ``value`` as an int, or raise :class:`CostModelError` if it is not one >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy integers are fine; floats that are whole are not (they hide unit bugs)
        try:
            import numbers

            if isinstance(value, numbers.Integral):
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise CostModelError(f"{what} must be an integer; got {value!r}") from None
    if value < minimum:
        raise CostModelError(f"{what} must be an integer >= {minimum}; got {value!r}")
    return value
