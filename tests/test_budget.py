"""Budget parsing: every accepted form and clear errors for the rest."""

from __future__ import annotations

import numpy as np
import pytest

import hrockmate
from hrockmate.budget import BudgetError, format_bytes, parse_budget


@pytest.mark.parametrize(
    "given, expected",
    [
        (123456, 123456),
        (np.int64(4096), 4096),
        ("6GiB", 6 * 1024**3),
        ("6gib", 6 * 1024**3),
        ("500MB", 500 * 1000**2),
        ("1.5 GiB", int(1.5 * 1024**3)),
        ("512 KiB", 512 * 1024),
        ("2kb", 2000),
        ("1TB", 1000**4),
        ("1 TiB", 1024**4),
        ("4096", 4096),
        ("4096B", 4096),
        (" 3 MiB ", 3 * 1024**2),
        ("1e3", 1000),
    ],
)
def test_sizes(given: object, expected: int) -> None:
    assert parse_budget(given) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "given, expected",
    [(0.5, 500), (1.0, 1000), (0.001, 1), ("50%", 500), ("100%", 1000), ("12.5 %", 125)],
)
def test_fractions_of_store_all(given: object, expected: int) -> None:
    assert parse_budget(given, store_all_peak=1000) == expected  # type: ignore[arg-type]


def test_fraction_is_floored_but_never_zero() -> None:
    assert parse_budget(0.3333, store_all_peak=10) == 3
    assert parse_budget(1e-9, store_all_peak=10) == 1


@pytest.mark.parametrize(
    "given, fragment",
    [
        (0, "positive"),
        (-5, "positive"),
        (1.5, "(0, 1]"),
        (0.0, "(0, 1]"),
        (-0.5, "(0, 1]"),
        (float("nan"), "(0, 1]"),
        ("150%", "(0, 1]"),
        ("6 GB of RAM", "cannot read"),
        ("lots", "cannot read"),
        ("", "cannot read"),
        ("6 GX", "unknown unit"),
        ("6 gigabytes", "unknown unit"),
        ("0.1B", "less than one byte"),
        (True, "not a memory size"),
        (None, "not a memory size"),
        ([1, 2], "not supported"),
    ],
)
def test_bad_budgets_say_what_is_wrong(given: object, fragment: str) -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget(given, store_all_peak=1000)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_fraction_without_store_all_peak() -> None:
    with pytest.raises(BudgetError, match="store-all peak"):
        parse_budget(0.5)


def test_error_lists_accepted_forms() -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget("much")
    msg = str(info.value)
    assert "'6GiB'" in msg and "(0, 1]" in msg and "int" in msg


def test_public_name() -> None:
    assert hrockmate.parse_budget is parse_budget


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
