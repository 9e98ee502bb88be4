"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# "ci": derandomised (the same examples every run); default: Hypothesis' usual exploration.
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("HROCKMATE_HYPOTHESIS_PROFILE", "default"))

REPO = Path(__file__).resolve().parents[1]


def shared_graphs_dir() -> Path:
    """The third-party training graphs (networkx node-link JSON) that sit beside the repository.

    Override with HROCKMATE_GRAPHS_DIR. They are test data, never copied into the repository.
    """
    env = os.environ.get("HROCKMATE_GRAPHS_DIR")
    return Path(env) if env else REPO.parent / "shared" / "data" / "graphs"


@pytest.fixture(scope="session")
def graphs_dir() -> Path:
    d = shared_graphs_dir()
    if not d.is_dir():
        pytest.fail(f"third-party graphs not found at {d}; set HROCKMATE_GRAPHS_DIR")
    return d
