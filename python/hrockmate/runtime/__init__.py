"""The execution runtime: ``HRockmate`` (``module``) runs a schedule, compiled once into
straight-line Python (``compiler``), inside autograd; docs/runtime.md describes it."""

from hrockmate.runtime.compiler import Program, RuntimeScheduleError, compile_schedule
from hrockmate.runtime.cpu_memory import keep_freed_cpu_memory
from hrockmate.runtime.cuda_memory import split_cuda_blocks
from hrockmate.runtime.module import (
    FiniteAssumptionError,
    HRockmate,
    InputMismatchError,
    ModelChangedError,
)
from hrockmate.runtime.shapes import OverBudgetWarning

__all__ = ["FiniteAssumptionError", "HRockmate", "InputMismatchError", "ModelChangedError",
           "OverBudgetWarning", "Program", "RuntimeScheduleError", "compile_schedule",
           "keep_freed_cpu_memory", "split_cuda_blocks"]
