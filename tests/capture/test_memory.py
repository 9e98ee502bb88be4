"""Peak-memory measurement by the budget definition (CPU: profiler allocator events)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hrockmate
from hrockmate import models
from hrockmate.capture.memory import eager_training_step, measure_eager_peak
from hrockmate.capture.trace import trace_model


def test_peak_is_the_running_maximum_of_allocations_during_the_step() -> None:
    def step() -> torch.Tensor:
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(3000, dtype=torch.uint8)
        del b
        c = torch.empty(500, dtype=torch.uint8)
        del c
        return a

    m = hrockmate.measure_peak_memory(step)
    assert isinstance(m, hrockmate.PeakMeasurement)
    assert m.peak_bytes == 4000
    assert m.baseline_bytes == 0 and m.device == "cpu"
    assert m.timeline == [1000, 4000, 1000, 1500, 1000]
    assert m.result.numel() == 1000  # the returned tensor stayed alive until the end


def test_memory_allocated_before_the_step_is_not_counted() -> None:
    kept = torch.empty(10**6, dtype=torch.uint8)

    def step() -> torch.Tensor:
        return kept.clone()

    assert hrockmate.measure_peak_memory(step).peak_bytes == 10**6


def test_parameter_grads_are_excluded_by_accumulating_in_place() -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 256, bias=False)
    x = torch.randn(1, 256)
    weight_bytes = 256 * 256 * 4
    step = eager_training_step(model, x)
    excluded = hrockmate.measure_peak_memory(step, params=model.parameters())
    # the weight gradient exists transiently (produced, then added into .grad): counted once,
    # but .grad itself, created before the baseline, is not
    assert weight_bytes <= excluded.peak_bytes < 2 * weight_bytes
    expected = torch.ones(1, 256).t() @ x
    assert torch.allclose(model.weight.grad, expected)

    # without the exclusion, autograd keeps the new gradient as .grad: it is still alive at the
    # end, so the same step's memory ends higher
    model.weight.grad = None
    counted = hrockmate.measure_peak_memory(step)
    assert counted.timeline is not None and excluded.timeline is not None
    assert counted.timeline[-1] - excluded.timeline[-1] == weight_bytes


def test_eager_peak_matches_with_or_without_traced_tangents() -> None:
    model, sample = models.mlp()
    traced = trace_model(model, sample, cost="none")
    a = measure_eager_peak(model, sample, traced=traced)
    b = measure_eager_peak(model, sample)
    assert a.peak_bytes == b.peak_bytes > 0


def test_tangent_count_must_match_outputs() -> None:
    model = nn.Linear(4, 4)
    step = eager_training_step(model, torch.randn(2, 4), tangents=[])
    with pytest.raises(ValueError, match="0 tangents given for 1 outputs"):
        step()


def test_unsupported_device_is_reported() -> None:
    with pytest.raises(ValueError, match="supports cpu and cuda"):
        hrockmate.measure_peak_memory(lambda: None, device="meta")
