"""What the training benchmarks report alike: the median step of each runner against its plain
reference, and the JSON file they write."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path
from typing import Any, Callable

import torch


def host() -> dict[str, Any]:
    return {"platform": platform.platform(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def step_summary(times: dict[str, list[float]], plain_of: Callable[[str], str]
                 ) -> dict[str, Any]:
    """Median step seconds of each runner, its ratio to the median of its plain reference
    (``plain_of(name)``), and how many steps were timed."""
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"step_s_median": {k: round(v, 5) for k, v in median.items()},
            "step_ratio_to_plain": {k: round(v / median[plain_of(k)], 4)
                                    for k, v in median.items()},
            "steps_timed": {k: len(v) for k, v in times.items()}}


def write(result: dict[str, Any], out: str | Path) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
