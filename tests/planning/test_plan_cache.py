"""The on-disk plan cache (plans and measured op times) and plans that stay the same across runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hrockmate
import hrockmate.capture.costs
import hrockmate.planning.api
from hrockmate import models
from hrockmate.capture.costs import TIME_GRID_STEPS, round_times
from hrockmate.ir.plan import load_plan
from hrockmate.planning.cache import CACHE_ENV, PlanCacheWarning, default_cache_dir, open_cache
from hrockmate.runtime import HRockmate

REPO = Path(__file__).resolve().parents[2]


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    return models.mlp(batch=16, d_in=32, hidden=64, n_layers=4, d_out=8)


def _build(cache: Any, budget: Any = 0.8, **options: Any) -> HRockmate:
    model, x = _model()
    return HRockmate(model, x, budget=budget, cache=cache, progress=False, **options)


def _entries(cache_dir: Path, kind: str) -> list[Path]:
    return sorted((cache_dir / kind).glob("*.json"))


@pytest.fixture
def no_measuring_or_solving(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if op times are measured or a graph is solved (workspaces may still be measured:
    tracing does that)."""
    measure = hrockmate.capture.costs.annotate_costs

    def no_measure(*args: Any, mode: str = "measure", **kwargs: Any) -> Any:
        assert mode != "measure", "op times were measured again"
        return measure(*args, mode=mode, **kwargs)

    def no_solve(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the graph was solved again")

    monkeypatch.setattr(hrockmate.capture.costs, "annotate_costs", no_measure)
    monkeypatch.setattr(hrockmate.planning.api, "solve_graph", no_solve)


# ---- reuse ---------------------------------------------------------------------------------------
def test_second_build_reuses_the_plan(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    first = _build(tmp_path)
    assert first.plan.method == "hrockmate" and first.recomputed_ops > 0
    assert first.plan.stats.get("cache") is None
    assert len(_entries(tmp_path, "plans")) == 1 and len(_entries(tmp_path, "times")) == 1

    request.getfixturevalue("no_measuring_or_solving")
    t0 = time.perf_counter()
    second = _build(tmp_path)
    seconds = time.perf_counter() - t0
    assert second.plan.stats["cache"] == "hit"
    assert second.plan.steps == first.plan.steps
    assert second.predicted_peak_bytes == first.predicted_peak_bytes
    print(f"second HRockmate(...) with the cached plan started in {seconds:.2f} s")


def test_new_budget_reuses_the_measured_times(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _build(tmp_path, budget=0.8)
    measure = hrockmate.capture.costs.annotate_costs

    def no_measure(*args: Any, mode: str = "measure", **kwargs: Any) -> Any:
        assert mode != "measure", "op times were measured again"
        return measure(*args, mode=mode, **kwargs)

    monkeypatch.setattr(hrockmate.capture.costs, "annotate_costs", no_measure)
    other = _build(tmp_path, budget=0.9)
    assert other.plan.stats.get("cache") is None  # solved: a plan per budget
    assert len(_entries(tmp_path, "plans")) == 2 and len(_entries(tmp_path, "times")) == 1


def test_key_separates_options_and_callers(tmp_path: Path) -> None:
    _build(tmp_path, time_limit=30.0)
    _build(tmp_path, time_limit=60.0)
    assert len(_entries(tmp_path, "plans")) == 2
    model, x = _model()
    plan = hrockmate.solve(model, x, 0.8, cache=tmp_path, progress=False, time_limit=30.0)
    assert plan.stats.get("cache") is None  # solve's plans are its own (no room for RNG states)
    assert len(_entries(tmp_path, "plans")) == 3


def test_another_build_of_the_planner_plans_again(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans are keyed by a digest of the planner's code, not only its version: a build that
    changed the planner (same version number) does not reuse the plans of the previous one."""
    from hrockmate.planning import cache

    first = cache.planner_fingerprint()
    assert first == cache.planner_fingerprint() and len(first) == 16
    _build(tmp_path)
    assert _build(tmp_path).plan.stats.get("cache") == "hit"
    monkeypatch.setattr(cache, "planner_fingerprint", lambda: "another build")
    assert _build(tmp_path).plan.stats.get("cache") is None
    assert len(_entries(tmp_path, "plans")) == 2


def test_solve_reuses_the_plan(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    model, x = _model()
    first = hrockmate.solve(model, x, 0.8, cache=tmp_path, progress=False)
    request.getfixturevalue("no_measuring_or_solving")
    second = hrockmate.solve(model, x, 0.8, cache=tmp_path, progress=False)
    assert second.stats["cache"] == "hit" and second.steps == first.steps
    assert second.graph_hash == hrockmate.trace(model, x, cost="estimate").structure_hash()


# ---- where, and off ------------------------------------------------------------------------------
def test_cache_false_and_off_write_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    _build(False)
    assert not (tmp_path / "env").exists()
    _build(None)  # the default location: here the environment variable's
    assert len(_entries(tmp_path / "env", "plans")) == 1
    monkeypatch.setenv(CACHE_ENV, "off")
    assert open_cache(None) is None
    with pytest.raises(TypeError, match="cache= must be a directory"):
        open_cache(3)


def test_default_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "hrockmate"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "hrockmate"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


# ---- damaged entries -----------------------------------------------------------------------------
@pytest.mark.parametrize("damage", [b"{not json", b"\xff\xfe\x00binary", b"[" * 100_000,
                                    b'{"format": "hrockmate-plan", "version": 1}'])
def test_corrupt_plan_entry_is_ignored(tmp_path: Path, damage: bytes) -> None:
    first = _build(tmp_path)
    [entry] = _entries(tmp_path, "plans")
    entry.write_bytes(damage)
    with pytest.warns(PlanCacheWarning, match="ignoring plan cache entry"):
        second = _build(tmp_path)
    assert second.plan.stats.get("cache") is None  # solved again ...
    assert load_plan(entry).steps == second.plan.steps  # ... and the entry replaced
    assert second.plan.steps == first.plan.steps  # same op times: same plan


def test_corrupt_times_entry_is_ignored(tmp_path: Path) -> None:
    _build(tmp_path)
    [entry] = _entries(tmp_path, "times")
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "times": data["times"][:-1]}))
    for plan_entry in _entries(tmp_path, "plans"):
        plan_entry.unlink()
    with pytest.warns(PlanCacheWarning, match=r"ignoring op-time cache entry .*expected \d+ op"):
        _build(tmp_path)
    assert len(json.loads(entry.read_text())["times"]) == len(data["times"])  # measured again


def test_unwritable_cache_only_warns(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory would be")
    with pytest.warns(PlanCacheWarning, match="cannot write"):
        h = _build(blocker)
    assert h.plan.method == "hrockmate"


# ---- stable plans --------------------------------------------------------------------------------
def test_rounded_times_ignore_a_uniform_change_of_speed() -> None:
    times = {"mm": 3.1e-4, "gelu": 2.2e-5, "view": 1.3e-6, "sum": 7.7e-6}
    weights = {"mm": 4, "gelu": 3, "view": 10, "sum": 1}
    base = round_times(times, weights)
    total = sum(t * weights[k] for k, t in times.items())
    for k, t in base.items():
        steps = math.log2(t / total) * TIME_GRID_STEPS
        assert abs(steps - round(steps)) < 1e-9, k  # on the grid
        assert abs(math.log2(t / times[k])) <= 0.5 / TIME_GRID_STEPS + 1e-12, k  # nearest line
    for speed in (0.5, 1.37, 3.0):
        scaled = round_times({k: t * speed for k, t in times.items()}, weights)
        for k in times:
            assert scaled[k] / speed == pytest.approx(base[k], rel=1e-12), (speed, k)


_RUN = textwrap.dedent("""
    import hashlib, json, sys
    import hrockmate.capture.costs as costmodel
    from hrockmate import models
    from hrockmate.runtime import HRockmate
    measured = []
    measure = costmodel.annotate_costs
    def counting(*args, mode="measure", **kwargs):
        measured.append(mode == "measure")
        return measure(*args, mode=mode, **kwargs)
    costmodel.annotate_costs = counting
    model, x = models.mlp(batch=16, d_in=32, hidden=64, n_layers=4, d_out=8)
    first = HRockmate(model, x, budget=0.8, cache=sys.argv[1], progress=False)
    second = HRockmate(model, x, budget=0.8, cache=sys.argv[1], progress=False)
    print(json.dumps({
        "steps": hashlib.sha256(repr(first.plan.steps).encode()).hexdigest(),
        "measured": any(measured),
        "second_from_cache": second.plan.stats.get("cache") == "hit",
    }))
""")


def _fresh_process(cache_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _RUN, str(cache_dir)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_same_plan_in_fresh_processes(tmp_path: Path) -> None:
    """A later run plans from the op times measured in the first one (the plans themselves are
    deleted in between, so the second run solves again): the same schedule."""
    first = _fresh_process(tmp_path)
    assert first["measured"] and first["second_from_cache"]
    for entry in _entries(tmp_path, "plans"):
        entry.unlink()
    again = _fresh_process(tmp_path)
    assert not again["measured"]
    assert again["steps"] == first["steps"]
