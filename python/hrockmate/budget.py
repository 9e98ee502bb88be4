"""Memory budgets: parsing the user's ``budget=`` argument into bytes.

A budget bounds *activation memory*: the peak, during forward and backward, of memory allocated
by the iteration beyond what was allocated before it started, not counting the parameters'
``.grad`` tensors (see docs/solver.md). It can be given as

- an ``int``: bytes (``6_000_000_000``);
- a string with a unit: ``"6GiB"``, ``"500MB"``, ``"1.5 gib"``, ``"4096"`` (bytes), ``"512 KiB"``;
  decimal units (kB, MB, GB, TB: powers of 1000) and binary units (KiB, MiB, GiB, TiB: powers of
  1024), case-insensitive;
- a ``float`` in (0, 1], or a string such as ``"50%"``: that fraction of the store-all peak
  (plain autograd's peak by the same measure).
"""

from __future__ import annotations

import math
import numbers
import re

UNITS: dict[str, int] = {
    "": 1,
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

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")

BudgetLike = int | float | str


class BudgetError(ValueError):
    """The budget argument cannot be understood; the message says which forms are accepted."""


_FORMS = (
    "give bytes as an int (e.g. 6442450944), a string with a unit (e.g. '6GiB', '500MB'), "
    "or a fraction of the store-all peak as a float in (0, 1] (e.g. 0.5) or a percentage "
    "string (e.g. '50%')"
)


def parse_budget(budget: BudgetLike, store_all_peak: int | None = None) -> int:
    """Return the budget in bytes.

    ``store_all_peak`` (bytes) is needed only for fractional budgets. Raises ``BudgetError``
    (a ``ValueError``) naming the problem for anything else.
    """
    if isinstance(budget, bool) or budget is None:
        raise BudgetError(f"budget {budget!r} is not a memory size; {_FORMS}")
    if isinstance(budget, numbers.Integral):
        value = int(budget)
        if value <= 0:
            raise BudgetError(f"budget must be a positive number of bytes, got {value}; {_FORMS}")
        return value
    if isinstance(budget, numbers.Real):
        return _fraction(float(budget), store_all_peak, repr(budget))
    if isinstance(budget, str):
        pct = _PERCENT.match(budget)
        if pct:
            return _fraction(float(pct.group(1)) / 100.0, store_all_peak, repr(budget))
        m = _NUMBER_UNIT.match(budget)
        if not m:
            raise BudgetError(f"cannot read budget {budget!r}; {_FORMS}")
        unit = m.group(2).lower()
        if unit not in UNITS:
            known = ", ".join(u for u in UNITS if u)
            raise BudgetError(
                f"unknown unit {m.group(2)!r} in budget {budget!r}; use one of {known} "
                "(case-insensitive)"
            )
        value = float(m.group(1)) * UNITS[unit]
        if not math.isfinite(value) or value < 1:
            raise BudgetError(f"budget {budget!r} is less than one byte; {_FORMS}")
        return int(value)
    raise BudgetError(f"budget of type {type(budget).__name__} is not supported; {_FORMS}")


def _fraction(frac: float, store_all_peak: int | None, shown: str) -> int:
    if not math.isfinite(frac) or not 0.0 < frac <= 1.0:
        raise BudgetError(
            f"fractional budget {shown} must be in (0, 1] (a fraction of the store-all peak); "
            "for a size in bytes pass an int or a string with a unit such as '6GiB'"
        )
    if store_all_peak is None:
        raise BudgetError(
            f"fractional budget {shown} needs the store-all peak to be known; pass bytes instead"
        )
    return max(1, int(math.floor(frac * store_all_peak)))


def format_bytes(n: float) -> str:
    """Human readable size with binary units, e.g. ``'1.50 GiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024.0
    return f"{value:.2f} TiB"
