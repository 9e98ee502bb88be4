"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# "ci": derandomised (the same examples every run); default: Hypothesis' usual exploration.
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("HROCKMATE_HYPOTHESIS_PROFILE", "default"))

REPO = Path(__file__).resolve().parents[1]

# Tests plan afresh and never write to the user's cache: the plan cache (on by default) is off
# for the whole session, subprocesses included, unless a test passes its own cache directory.
os.environ["HROCKMATE_CACHE_DIR"] = "off"


# The repository's own graphs (tests/data/make_graphs.py writes them): every core test uses these.
DATA_GRAPHS = REPO / "tests" / "data" / "graphs"


def third_party_graphs_dir() -> Path:
    """Optional extra test data: third-party training graphs (networkx node-link JSON), e.g.
    the Checkmate graphs, in the folder named by HROCKMATE_GRAPHS_DIR (default: a
    ``shared/data/graphs`` folder beside the repository). Never copied into the repository."""
    env = os.environ.get("HROCKMATE_GRAPHS_DIR")
    return Path(env) if env else REPO.parent / "shared" / "data" / "graphs"


@pytest.fixture(scope="session")
def data_graphs() -> Path:
    assert DATA_GRAPHS.is_dir(), f"{DATA_GRAPHS} is missing: run tests/data/make_graphs.py"
    return DATA_GRAPHS


@pytest.fixture(scope="session")
def graphs_dir() -> Path:
    """The third-party graphs; tests that use them skip, saying why, when they are absent."""
    d = third_party_graphs_dir()
    if not d.is_dir() or not any(d.glob("*.json")):
        pytest.skip(f"third-party graphs not found at {d} (optional: set HROCKMATE_GRAPHS_DIR)")
    return d


def corpus_files() -> list[Path]:
    """The repository's graphs, then the third-party ones when they are present."""
    files = sorted(DATA_GRAPHS.glob("*.json"))
    extra = third_party_graphs_dir()
    if extra.is_dir():
        files += sorted(extra.glob("*.json"))
    return files


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread for a module's tests (restored afterwards): the test models
    are tiny, and extra threads only add overhead and noise. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
