"""The names code written against the single tracing module imports, kept importable from here.
New code imports them from where they live: ``capture.trace`` (``trace_model``, ``trace``),
``capture.joint`` (``Traced``, ``TraceError``, the sample and output helpers, ``run_joint``),
``capture.randomness`` and ``capture.build``."""

from hrockmate.capture.build import CUDA_BLOCK_BYTES, allocated_bytes
from hrockmate.capture.joint import (
    LossFn,
    TensorHolder,
    TensorLeaf,
    Traced,
    TraceError,
    coerce_like,
    flatten_output,
    one_trace_at_a_time,
    placeholder_values,
    rebuild_output,
    run_joint,
    select_loss,
    select_member,
    split_sample,
)
from hrockmate.capture.randomness import preserved_rng, replay_python_draws
from hrockmate.capture.trace import COST_MODES, trace, trace_model

__all__ = [
    "COST_MODES", "CUDA_BLOCK_BYTES", "LossFn", "TensorHolder", "TensorLeaf", "TraceError",
    "Traced", "allocated_bytes", "coerce_like", "flatten_output", "one_trace_at_a_time",
    "placeholder_values", "preserved_rng", "rebuild_output", "replay_python_draws", "run_joint",
    "select_loss", "select_member", "split_sample", "trace", "trace_model",
]
