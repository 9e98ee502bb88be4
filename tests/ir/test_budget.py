"""Budget parsing: every accepted form and clear errors for the rest."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hrockmate
from hrockmate.ir.budget import BudgetError, format_bytes, parse_budget


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


@pytest.mark.parametrize("peak", [2**53 + 1, 2**62 + 3, 2**63 - 1, 2**64 + 12345])
@pytest.mark.parametrize("whole", [1, 1.0, "1", "1.0", "100%", np.float64(1.0)])
def test_one_is_the_store_all_peak_exactly_above_2_to_the_53(peak: int, whole: object) -> None:
    assert parse_budget(whole, store_all_peak=peak) == peak  # type: ignore[arg-type]


@given(peak=st.integers(1, 2**80), percent=st.integers(1, 100))
def test_fractions_are_exact_and_rounded_down(peak: int, percent: int) -> None:
    expected = max(1, peak * percent // 100)
    assert parse_budget(f"{percent}%", store_all_peak=peak) == expected
    assert parse_budget(percent / 100, store_all_peak=peak) == expected


def test_decimal_fractions_are_read_as_written() -> None:
    # 0.29 * 100 is 28.999999999999996 in floating point
    assert parse_budget(0.29, store_all_peak=100) == 29
    assert parse_budget("0.29", store_all_peak=100) == 29


@pytest.mark.parametrize(
    "given, expected",
    [(1, 1000), ("1", 1000), (0.5, 500), ("0.5", 500), ("50%", 500), (2, 2), ("2", 2),
     (4096, 4096), ("4096", 4096), (6e9, 6_000_000_000), ("2KiB", 2048)],
)
def test_one_grammar_for_bare_numbers(given: object, expected: int) -> None:
    """A bare number in (0, 1] is a fraction of the store-all peak, a whole number above 1 is
    bytes: the same for ints, floats and the strings typed on the command line."""
    assert parse_budget(given, store_all_peak=1000) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("given", [1.5, "1.5", 1000.25])
def test_numbers_above_one_must_be_whole_bytes(given: object) -> None:
    with pytest.raises(BudgetError, match="not a whole number"):
        parse_budget(given, store_all_peak=1000)  # type: ignore[arg-type]


@pytest.mark.parametrize("given", ["1" * 200, "1e99999", "5" * 5000 + "GB"])
def test_huge_numbers_are_refused_quickly(given: str) -> None:
    with pytest.raises(BudgetError):
        parse_budget(given, store_all_peak=1000)


def test_fraction_without_store_all_peak() -> None:
    with pytest.raises(BudgetError, match="store-all peak"):
        parse_budget(0.5)


def test_error_lists_accepted_forms() -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget("much")
    msg = str(info.value)
    assert "'6GiB'" in msg and "(0, 1]" in msg and "whole number" in msg


def test_public_name() -> None:
    assert hrockmate.parse_budget is parse_budget


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
