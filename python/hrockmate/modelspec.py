"""What a benchmark zoo entry is (``ModelSpec``) and how an entry says it cannot be built here
(``ModelUnavailable``): shared by the zoo modules and the benchmark runner, which imports the zoos
(``hrockmate.bench`` re-exports both for zoo modules of one's own). Plain Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ModelSpec", "ModelUnavailable"]


class ModelUnavailable(RuntimeError):
    """A zoo entry cannot be built here (e.g. an optional package is missing); skipped."""


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: ``build(size) -> (model, sample)`` and ``blocks(model)`` -> the
    submodules a user would wrap in ``torch.utils.checkpoint``."""

    name: str
    description: str
    build: Callable[[str], tuple[Any, Any]]
    blocks: Callable[[Any], list[Any]]
