"""Tracing transformers' decoders for training without their cache of keys and values.

A training step never reads the cache a decoder returns by default (``use_cache=True``), and
a returned cache keeps every layer's keys and values referenced by the caller until backward
ends, so no plan could free or recompute them; transformers' own gradient checkpointing turns
it off in training for the same reason. This module has no import of the runtime, which
traces within ``training_without_cache``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator

import torch.nn as nn

__all__ = ["training_without_cache"]

logger = logging.getLogger("hrockmate.runtime.module")
_told: set[type] = set()


@contextlib.contextmanager
def training_without_cache(model: nn.Module, sample: Any) -> Iterator[bool]:
    """Within it, a transformers model in training mode whose configs turn the cache of keys
    and values on (``use_cache=True``, the library's default for decoders) runs without it,
    as transformers' own gradient checkpointing runs it: a training step never reads that
    cache, and returning it keeps every layer's keys and values referenced by the caller,
    so a plan could not free or recompute them. ``HRockmate`` traces within it when given a
    budget or a plan. Nothing changes for a sample that passes ``use_cache`` itself (the
    caller's choice: ``use_cache=True`` returns the cache, and the plan charges it), for a
    model in eval mode, and for models that are not transformers'. Yields whether the cache
    was turned off; the configs are restored on exit."""
    configs = []
    base = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    passed = isinstance(sample, dict) and "use_cache" in sample
    if base is not None and isinstance(model, base) and model.training and not passed:
        seen: set[int] = set()
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is None or id(config) in seen:
                continue
            seen.add(id(config))
            if getattr(config, "use_cache", False) is True:
                configs.append(config)
    if configs and type(model) not in _told:
        _told.add(type(model))  # (once per class: each input shape traces again)
        logger.warning(
            "HRockmate: tracing %s with use_cache=False, as transformers' gradient "
            "checkpointing trains it: a training step never reads the cache of keys and "
            "values, and returning it would keep them to the end of backward (pass "
            "use_cache=True in the sample to return it, or use_cache=False to silence this)",
            type(model).__name__)
    try:
        for config in configs:
            config.use_cache = False
        yield bool(configs)
    finally:
        for config in configs:
            config.use_cache = True
