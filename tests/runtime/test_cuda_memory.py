"""The CUDA caching allocator: expandable segments turned on where the user left them unset,
and the slack budgeted where they stay off."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from hrockmate.runtime import cuda_memory
from hrockmate.runtime.cuda_memory import (
    CUDA_LARGE_POOL_SLACK,
    CUDA_OVERSIZE_SLACK,
    allocator_slack_bytes,
    split_cuda_blocks,
)

_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", cuda_memory.ENV_VAR)


@pytest.fixture
def fresh_allocator(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """No allocator settings anywhere and a process that has not decided yet; returns the
    settings ``split_cuda_blocks`` makes (recorded, not made)."""
    for var in _VARS:
        monkeypatch.delenv(var, raising=False)
    made: list[str] = []
    monkeypatch.setattr(cuda_memory, "_state", None)
    monkeypatch.setattr(cuda_memory, "_settings_from_python", lambda: ",".join(made))
    monkeypatch.setattr(cuda_memory, "_set_settings", made.append)
    return made


def _graph_with_a_large_tensor():  # noqa: ANN202 - a test graph
    from graph_builders import training_graph

    g = training_graph(6, seed=1)
    g.tensors[3].bytes = 4 * CUDA_LARGE_POOL_SLACK
    return g


def test_expandable_segments_are_turned_on_once_where_unset(
        fresh_allocator: list[str], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    g, cuda = _graph_with_a_large_tensor(), torch.device("cuda")
    assert allocator_slack_bytes(g, cuda) == CUDA_LARGE_POOL_SLACK
    with caplog.at_level(logging.INFO, logger="hrockmate.runtime.cuda_memory"):
        assert split_cuda_blocks() and split_cuda_blocks()
    assert fresh_allocator == ["expandable_segments:True"]  # (once per process)
    assert "expandable segments are on" in caplog.text
    # every block split; 1 MiB kept for small allocations the graph does not count
    assert allocator_slack_bytes(g, cuda) == CUDA_LARGE_POOL_SLACK
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:2")
    assert allocator_slack_bytes(g, cuda) == CUDA_LARGE_POOL_SLACK  # (oversize blocks split)


@pytest.mark.parametrize("where", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "python",
                                   cuda_memory.ENV_VAR])
def test_the_users_choice_is_kept_and_its_risk_named(
        where: str, fresh_allocator: list[str], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    if where == "python":
        fresh_allocator.append("expandable_segments:False")
    elif where == cuda_memory.ENV_VAR:
        monkeypatch.setenv(where, "0")
    else:
        monkeypatch.setenv(where, "max_split_size_mb:512,expandable_segments:False")
    made = list(fresh_allocator)
    with caplog.at_level(logging.WARNING, logger="hrockmate.runtime.cuda_memory"):
        assert not split_cuda_blocks()
    assert fresh_allocator == made  # nothing set
    assert "up to 1 MiB larger" in caplog.text and "expandable_segments:True" in caplog.text
    assert (f"{cuda_memory.ENV_VAR}=0" in caplog.text) == (where == cuda_memory.ENV_VAR)
    assert allocator_slack_bytes(_graph_with_a_large_tensor(), torch.device("cuda")) == (
        CUDA_LARGE_POOL_SLACK)


def test_expandable_segments_the_user_turned_on_are_left_as_they_are(
        fresh_allocator: list[str], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with caplog.at_level(logging.INFO, logger="hrockmate.runtime.cuda_memory"):
        assert split_cuda_blocks()
    assert fresh_allocator == [] and caplog.text == ""


def test_a_setting_torch_refuses_leaves_the_slack_budgeted(
        fresh_allocator: list[str], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def refuse(text: str) -> None:
        raise RuntimeError("unknown allocator setting")

    monkeypatch.setattr(cuda_memory, "_set_settings", refuse)
    with caplog.at_level(logging.WARNING, logger="hrockmate.runtime.cuda_memory"):
        assert not split_cuda_blocks()
    assert "could not turn on" in caplog.text and "unknown allocator setting" in caplog.text
    assert allocator_slack_bytes(_graph_with_a_large_tensor(), torch.device("cuda")) == (
        CUDA_LARGE_POOL_SLACK)


def test_torch_takes_the_setting() -> None:
    """In a fresh process (the setting is process-wide), this torch accepts the call, and
    reports the setting back where it can (torch 2.11 does not); no GPU is needed to set it."""
    probe = textwrap.dedent("""
        import os
        for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            os.environ.pop(var, None)
        from hrockmate.runtime.cuda_memory import allocator_settings, split_cuda_blocks
        import torch
        assert split_cuda_blocks()
        getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        if getter is not None and getter():
            assert allocator_settings().get("expandable_segments") == "True"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_allocator_slack_is_kept_on_cuda_only_where_large_pool_requests_occur(
        fresh_allocator: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA allocator may hand a request over 1 MiB a cached block up to 1 MiB larger:
    that slack is budgeted only on CUDA, only when the graph makes such requests (a tensor
    or an op's workspace); with expandable segments blocks of max_split_size_mb are split
    too."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    from graph_builders import training_graph

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    g = training_graph(6, seed=1)
    assert allocator_slack_bytes(g, cuda) == 0  # every tensor and workspace of a few bytes
    g.tensors[3].bytes = CUDA_LARGE_POOL_SLACK  # exactly 1 MiB: still the small pool
    assert allocator_slack_bytes(g, cuda) == 0
    g.tensors[3].bytes = CUDA_LARGE_POOL_SLACK + 512
    assert allocator_slack_bytes(g, cuda) == CUDA_LARGE_POOL_SLACK
    assert allocator_slack_bytes(g, cpu) == 0
    g.tensors[3].bytes = 64
    g.ops[2].workspace = 4 * CUDA_LARGE_POOL_SLACK
    assert allocator_slack_bytes(g, cuda) == CUDA_LARGE_POOL_SLACK
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert allocator_slack_bytes(g, cuda) == CUDA_LARGE_POOL_SLACK
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(var, "garbage_collection_threshold:0.6, expandable_segments:True")
        assert allocator_slack_bytes(g, cuda) == CUDA_LARGE_POOL_SLACK
        monkeypatch.setenv(var, "expandable_segments:False")
        assert allocator_slack_bytes(g, cuda) == CUDA_LARGE_POOL_SLACK
        monkeypatch.delenv(var)
    # blocks of at least max_split_size_mb are never split: a request that large may get one
    # up to 20 MiB larger (the largest request here is the 4 MiB workspace)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:4")
    assert allocator_slack_bytes(g, cuda) == CUDA_OVERSIZE_SLACK == 20 << 20
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:5")
    assert allocator_slack_bytes(g, cuda) == CUDA_LARGE_POOL_SLACK
