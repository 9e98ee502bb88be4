"""Peak-memory measurement by the budget definition (CPU: profiler allocator events)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hrockmate
from hrockmate import models
from hrockmate.capture.memory import eager_training_step, measure_eager_peak, measure_peak_memory
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


def _freed_on_another_thread() -> None:
    """4000 B and 8000 B allocated, the 8000 B buffer's last reference dropped on another
    thread (as a collective's worker thread does), then 2000 B: the peak is 12000 B."""
    import threading

    held = [torch.ones(1000)]
    box = [torch.ones(2000)]
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    held.append(torch.ones(500))


def test_tensor_count_sees_frees_made_on_other_threads() -> None:
    # the profiler misses the other thread's free and keeps those bytes: 14000 B
    assert measure_peak_memory(_freed_on_another_thread, count="allocator").peak_bytes > 12000
    live = measure_peak_memory(_freed_on_another_thread, count="tensors")
    assert live.peak_bytes == 12000
    assert live.timeline is not None and live.timeline[-1] == 0


def test_tensor_count_ignores_views_of_earlier_tensors_and_follows_storage_resizes() -> None:
    base = torch.zeros(1000)  # (allocated before the step: not counted, nor its views)
    hold: list[torch.Tensor] = []

    def step() -> None:
        hold.append(base[10:].view(2, 495))
        hold.append(base.add(1))  # 4000 B new
        base.untyped_storage().resize_(2000 * 4)  # +4000 B in place (FSDP2 gathers so)
        base.untyped_storage().resize_(0)  # -8000 B: the storage's own 4000 B freed too
        hold.clear()  # -4000 B

    live = measure_peak_memory(step, count="tensors")
    assert live.peak_bytes == 8000
    assert live.timeline == [4000, 8000, 0, -4000]


def test_tensor_count_agrees_with_the_allocator_on_a_training_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)

    def step() -> None:
        model(x).sum().backward()

    params = list(model.parameters())
    allocator = measure_peak_memory(step, params=params, count="allocator").peak_bytes
    tensors = measure_peak_memory(step, params=params, count="tensors").peak_bytes
    # (the allocator also sees what an op allocates and frees within itself)
    assert 0.9 * allocator <= tensors <= allocator


def test_unknown_count_is_refused() -> None:
    with pytest.raises(ValueError, match="count must be"):
        measure_peak_memory(lambda: None, count="bytes")
