"""SolveContext: frozen settings of one try, and sub-solves that get their own share of time."""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import pytest

from hrockmate.planning import context
from hrockmate.planning.context import SolveContext


def test_a_context_is_frozen_and_replace_leaves_the_original() -> None:
    ctx = SolveContext(flat_ops=60, leaf_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.leaf_size = 4  # type: ignore[misc]
    other = ctx.replace(leaf_size=4, low_peak=True)
    assert (other.leaf_size, other.low_peak) == (4, True)
    assert (ctx.leaf_size, ctx.low_peak) == (8, False)


def test_limited_gives_a_sub_solve_its_own_deadline() -> None:
    now = time.perf_counter()
    ctx = SolveContext(time_limit=100.0, deadline=now + 100.0)
    before = time.perf_counter()
    sub = ctx.limited(5.0, flat_ops=0)
    after = time.perf_counter()
    assert sub.time_limit == 5.0 and sub.flat_ops == 0
    # (5 s from the moment it was made, however long the machine took to get there)
    assert sub.deadline is not None and before + 5.0 <= sub.deadline <= after + 5.0
    left = sub.time_left()
    assert left is not None and 0.0 < left <= 5.0
    # the parent's clock is unchanged
    assert ctx.deadline == now + 100.0
    unbounded = ctx.limited(math.inf)
    assert unbounded.time_limit is None and unbounded.deadline is None
    assert unbounded.time_left() is None


def test_time_left_never_goes_below_zero() -> None:
    ctx = SolveContext(deadline=time.perf_counter() - 10.0)
    assert ctx.time_left() == 0.0


def test_with_plan_marks_a_try_that_can_only_improve() -> None:
    ctx = SolveContext()
    assert ctx.fallback_log_level == logging.WARNING and not ctx.plan_in_hand
    later = ctx.with_plan(3.0)
    assert later.plan_in_hand and later.time_limit == 3.0
    assert later.log_level == later.fallback_log_level == logging.INFO


def test_improve_seconds_reads_the_window_and_the_limit() -> None:
    now = time.perf_counter()
    ctx = SolveContext(improve_until=now + 7.0, deadline=now + 3.0)
    seconds = ctx.improve_seconds()
    assert seconds is not None and seconds <= 3.0
    # under MIN_TRY_SECONDS of the window left: no try
    assert SolveContext(improve_until=now + 0.5).improve_seconds() is None
    assert SolveContext().improve_seconds() == math.inf


def test_the_simple_strategies_memo_does_not_take_part_in_equality() -> None:
    assert SolveContext(simple_memo=[object()]) == SolveContext()


def test_the_constants_module_imports_nothing_of_the_planner() -> None:
    # (so that every planning module may import it without a circle)
    import ast
    from pathlib import Path

    tree = ast.parse(Path(context.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith("hrockmate.planning")}
