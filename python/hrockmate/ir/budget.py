"""Memory budgets: parsing the user's ``budget=`` argument into bytes.

A budget bounds *activation memory*: the peak, during forward and backward, of memory allocated
by the iteration beyond what was allocated before it started, not counting the parameters'
``.grad`` tensors (see docs/solver.md). One grammar serves the Python API and every command:

- a number in (0, 1] (``0.5``, ``1``, ``"0.5"``), or a percentage string (``"50%"``): that
  fraction of a reference peak: for a graph alone the traced store-all peak; for a model
  (``HRockmate``, ``solve``) the smaller of plain PyTorch's measured peak and the traced
  store-all's (``capture.baseline``, docs/budget.md);
- a whole number above 1 (``6_000_000_000``, ``"4096"``): bytes;
- a string with a unit: ``"6GiB"``, ``"500MB"``, ``"1.5 gib"``, ``"4096B"``, ``"512 KiB"``;
  decimal units (kB, MB, GB, TB: powers of 1000) and binary units (KiB, MiB, GiB, TiB: powers of
  1024), case-insensitive.

A number above 1 that is not whole (``1.5``) is refused: it is neither. Numbers are read
exactly (decimal strings and floats through ``fractions.Fraction``), so ``1`` is the reference
peak to the byte however large it is, and fractions are rounded down.
"""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]{1,3})?)\s*([a-z]*)\s*$", re.IGNORECASE)
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")
# Budget strings are short; exact arithmetic on longer numbers would only cost time.
_MAX_LENGTH = 80

BudgetLike = int | float | str


class BudgetError(ValueError):
    """The budget argument cannot be understood; the message says which forms are accepted."""


_FORMS = (
    "give a fraction of the store-all peak as a number in (0, 1] (e.g. 0.5 or 1) or a "
    "percentage (e.g. '50%'), or bytes as a whole number above 1 (e.g. 6442450944) or a size "
    "with a unit (e.g. '6GiB', '500MB')"
)


def parse_budget(budget: BudgetLike, store_all_peak: int | None = None) -> int:
    """Return the budget in bytes.

    ``store_all_peak`` (bytes), the reference peak a fraction is of, is needed only for
    fractional budgets. Raises ``BudgetError``
    (a ``ValueError``) naming the problem for anything else.
    """
    value, shown = _read(budget)
    if isinstance(value, int):
        return value
    if store_all_peak is None:
        raise BudgetError(
            f"fractional budget {shown} needs the store-all peak to be known; pass bytes instead"
        )
    return max(1, math.floor(value * int(store_all_peak)))


def is_fraction(budget: BudgetLike) -> bool:
    """Whether ``budget`` is a fraction (a number in (0, 1] or a percentage) rather than a
    size in bytes; raises ``BudgetError`` for what is neither, as ``parse_budget`` does."""
    return not isinstance(_read(budget)[0], int)


def parse_fraction(budget: BudgetLike) -> float:
    """A budget that must be a fraction of the store-all peak (a number in (0, 1] or a
    percentage, read as ``parse_budget`` reads them), e.g. for benchmarks over models of every
    size. Raises ``BudgetError`` for anything else, sizes in bytes included."""
    value, shown = _read(budget)
    if isinstance(value, int):
        raise BudgetError(f"budget {shown} is a size in bytes; give a fraction of the store-all "
                          "peak as a number in (0, 1] (e.g. 0.5 or 1) or a percentage ('50%')")
    return float(value)


def _read(budget: BudgetLike) -> tuple[int | Fraction, str]:
    """(bytes as an int, or a Fraction in (0, 1] of the store-all peak; the budget as shown in
    messages)."""
    shown = repr(budget)
    if isinstance(budget, bool) or budget is None:
        raise BudgetError(f"budget {shown} is not a memory size; {_FORMS}")
    if isinstance(budget, numbers.Integral):
        return _plain_number(Fraction(int(budget)), shown), shown
    if isinstance(budget, numbers.Real):
        value = float(budget)
        if not math.isfinite(value):
            raise BudgetError(f"budget {shown} is not a finite number; {_FORMS}")
        # repr is the shortest decimal that reads back as this float: 0.29 means 29/100
        return _plain_number(Fraction(repr(value)), shown), shown
    if not isinstance(budget, str):
        raise BudgetError(f"budget of type {type(budget).__name__} is not supported; {_FORMS}")
    if len(budget) > _MAX_LENGTH:
        raise BudgetError(f"budget {budget[:20]!r}... is too long; {_FORMS}")
    pct = _PERCENT.match(budget)
    if pct:
        return _fraction(Fraction(pct.group(1)) / 100, shown), shown
    m = _NUMBER_UNIT.match(budget)
    if not m:
        raise BudgetError(f"cannot read budget {shown}; {_FORMS}")
    number, unit = Fraction(m.group(1)), m.group(2).lower()
    if not unit:
        return _plain_number(number, shown), shown
    if unit not in UNITS:
        raise BudgetError(
            f"unknown unit {m.group(2)!r} in budget {shown}; use one of {', '.join(UNITS)} "
            "(case-insensitive)"
        )
    size = math.floor(number * UNITS[unit])
    if size < 1:
        raise BudgetError(f"budget {shown} is less than one byte; {_FORMS}")
    return size, shown


def _plain_number(value: Fraction, shown: str) -> int | Fraction:
    """A number without a unit: a fraction in (0, 1], else a whole number of bytes."""
    if value <= 0:
        raise BudgetError(f"budget {shown} must be positive; {_FORMS}")
    if value <= 1:
        return value
    if value.denominator != 1:
        raise BudgetError(
            f"budget {shown} is above 1, so it would be bytes, but it is not a whole number; "
            f"{_FORMS}"
        )
    return int(value)


def _fraction(frac: Fraction, shown: str) -> Fraction:
    if not 0 < frac <= 1:
        raise BudgetError(
            f"fractional budget {shown} must be in (0, 1] (a fraction of the store-all peak); "
            "for a size in bytes give a whole number above 1 or a string with a unit such as "
            "'6GiB'"
        )
    return frac


def format_bytes(n: float) -> str:
    """Human readable size with binary units, e.g. ``'1.50 GiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024.0
    return f"{value:.2f} TiB"
