"""Checks for parameters: a bad value fails early, naming the parameter and the rule (papermill passes `-p x -5`
or `-p flag no` through as given). Numpy numbers count as numbers; bools never do."""

from __future__ import annotations

import math
import numbers


def is_int(k) -> bool:
    return isinstance(k, numbers.Integral) and not isinstance(k, bool)


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_int(name: str, v, lo: int = 1, rule: str = "") -> int:
    """v as a Python int, once it is an int >= lo; `rule` is appended to the message (e.g. ' or None')."""
    if not is_int(v) or v < lo:
        raise ValueError(f"{name}={v!r}: must be an int >= {lo}{rule}")
    return int(v)


def check_ints(lo: int, note: str = "", **values) -> None:
    """Every value an int >= lo; `note` says what the lowest value means."""
    for name, v in values.items():
        check_int(name, v, lo, f" ({note})" if note else "")


def check_bools(**values) -> None:
    """Every value True or False (a string such as 'no' would count as True)."""
    for name, v in values.items():
        if not isinstance(v, bool):
            raise ValueError(f"{name}={v!r}: must be True or False")


def check_fractions(allow_empty: bool = True, **values) -> None:
    """Every value a list of numbers in (0, 1), such as routed-expert reductions."""
    for name, v in values.items():
        if not (isinstance(v, (list, tuple)) and (allow_empty or v) and all(is_real(x) and 0 < x < 1 for x in v)):
            raise ValueError(f"{name}={v!r}: must be a list of numbers in (0, 1), e.g. [0.1, 0.25]"
                             + ("" if allow_empty else ", not empty"))


def check_real(name: str, v, lo: float, hi: float = math.inf) -> None:
    """A finite number in [lo, hi] (hi may be inf)."""
    if not is_real(v) or not (lo <= v <= hi and math.isfinite(v)):
        raise ValueError(f"{name}={v!r}: must be a number in [{lo}, {hi}]")
