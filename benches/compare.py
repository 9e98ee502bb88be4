"""The side-by-side benchmark in one command: every zoo model, every method, every budget.

    python benches/compare.py                                  # all models, small sizes, CPU
    python benches/compare.py --models gpt2,unet --iterations 10
    python benches/compare.py --size large --device cuda       # on a GPU

Same flags as ``hrockmate bench`` (see ``--help``). Writes ``bench-results/bench.json``, one
Pareto plot per model (``bench-results/<model>.png``) and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import sys

from hrockmate.bench import add_arguments, run_from_args
from hrockmate.zoo import ZOO


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benches/compare.py",
        description="hrockmate against plain autograd, torch.utils.checkpoint, torch.compile's "
        "activation_memory_budget and Checkmate's exact MILP, at budgets given as fractions of "
        "the store-all peak.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    command = " ".join(["python benches/compare.py", *(argv if argv is not None else sys.argv[1:])])
    run_from_args(args, ZOO, command=command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
