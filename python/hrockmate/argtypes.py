"""Types of command-line values shared by ``hrockmate.cli`` and the benchmark's flags
(``hrockmate.bench``). Plain Python, no torch.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["seconds"]


def seconds(text: str) -> float:
    """A time limit typed on the command line: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds above 0 (e.g. 60), got {text!r}")
    return value
