"""How long each bounded stop takes: refusals of too-large work, solves at their time limit, and
Ctrl-C or a cancellation reaching a native call, a HiGHS solve or the block threads.

``tests/planning/test_bounds.py`` asserts that each stop happens (which error, which stop
reason, that the call returned while the work it abandoned still ran); wall-clock seconds are
measured here instead, since they flake as assertions on a loaded machine. Each case is run
``--repeat`` times; the JSON keeps every run's seconds, the median and the target.

    python benches/bounds.py                       # writes benches/results/bounds.json
    python benches/bounds.py --repeat 5 --out /tmp/bounds.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "planning"), str(REPO / "tests")]

from test_bounds import _hard_knapsack, training_chain  # noqa: E402  (the tests' own inputs)

import hrockmate  # noqa: E402
from hrockmate import _native  # noqa: E402
from hrockmate.planning import ilp, literature  # noqa: E402
from hrockmate.ir.schedule import recompute_all_schedule  # noqa: E402


def _seconds(fn: Callable[[], object], expect: type[BaseException] | None) -> float:
    start = time.perf_counter()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        if expect is None or not isinstance(exc, expect):
            raise
    else:
        if expect is not None:
            raise AssertionError(f"expected {expect.__name__}")
    return time.perf_counter() - start


def _refuse_recompute_all() -> None:
    recompute_all_schedule(training_chain(100_000))


def _refuse_rotor() -> None:
    literature.rotor(training_chain(10_000), 10**9)


def _rotor_time_limit() -> None:
    literature.rotor(training_chain(1_000), 20_000, time_limit=2, max_table_bytes=2**28)


def _solve_graph_rotor() -> None:
    hrockmate.solve_graph(training_chain(1_000), 0.3, method="rotor", time_limit=3,
                          progress=False)


def _checkmate_too_large() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hrockmate.solve_graph(training_chain(300), 0.1, method="checkmate", time_limit=5,
                              progress=False)


def _highs_deadline() -> None:
    ilp.run_highs(_hard_knapsack(), deadline=time.perf_counter() + 1.0)


def _cancel_latency() -> float:
    cancel = threading.Event()
    done = threading.Event()

    def solve() -> None:
        try:
            with ilp.cancelled_by(cancel):
                ilp.run_highs(_hard_knapsack())
        except ilp.SolveCancelled:
            pass
        done.set()

    worker = threading.Thread(target=solve)
    worker.start()
    time.sleep(0.5)
    sent = time.perf_counter()
    cancel.set()
    done.wait(60.0)
    worker.join()
    return time.perf_counter() - sent


_PRELUDE = f"""
import sys
sys.path[:0] = [{str(REPO / "tests" / "planning")!r}, {str(REPO / "tests")!r}]
from test_bounds import training_chain, _hard_knapsack
"""


def _ctrl_c_latency(code: str) -> float:
    """Seconds from SIGINT to the exit of a process running ``code`` (which prints "started"
    as its long call begins)."""
    p = subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stdout is not None
    if p.stdout.readline().strip() != "started":
        raise RuntimeError(p.communicate()[1])
    time.sleep(1.0)
    sent = time.perf_counter()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    if "KeyboardInterrupt" not in err:
        raise RuntimeError(f"the process did not stop on Ctrl-C: {err[-400:]}")
    return time.perf_counter() - sent


_CTRL_C_ROTOR = """
from hrockmate.planning import literature
g = training_chain(1_000)
print("started", flush=True)
literature.rotor(g, 20_000, max_table_bytes=2**27)
"""

_CTRL_C_HIGHS = """
from hrockmate.planning.ilp import run_highs
h = _hard_knapsack()
print("started", flush=True)
run_highs(h)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benches" / "results" / "bounds.json"))
    ns = ap.parse_args(argv)

    # (name, what is measured, target seconds, one run)
    cases: list[tuple[str, str, float, Callable[[], float]]] = [
        ("recompute_all_200k_refused", "refusal of a 200k-op recompute-all", 10.0,
         lambda: _seconds(_refuse_recompute_all, MemoryError)),
        ("rotor_10k_refused", "refusal of Rotor's tables on 10k stages", 5.0,
         lambda: _seconds(_refuse_rotor, _native.TooLargeError)),
        ("rotor_time_limit_2s", "Rotor on 1k stages, time_limit=2", 2.5,
         lambda: _seconds(_rotor_time_limit, _native.TimeLimitError)),
        ("solve_graph_rotor_3s", "solve_graph(method='rotor', time_limit=3)", 4.0,
         lambda: _seconds(_solve_graph_rotor, TimeoutError)),
        ("checkmate_too_large_5s", "solve_graph(method='checkmate', time_limit=5), 600 ops", 6.0,
         lambda: _seconds(_checkmate_too_large, None)),
        ("highs_deadline_1s", "run_highs with a 1 s deadline", 1.5,
         lambda: _seconds(_highs_deadline, None)),
        ("cancel_highs", "a cancelled HiGHS solve returning (another thread)", 1.0,
         _cancel_latency),
        ("ctrl_c_rotor", "Ctrl-C to exit during a native Rotor call", 1.0,
         lambda: _ctrl_c_latency(_CTRL_C_ROTOR)),
        ("ctrl_c_highs", "Ctrl-C to exit during a HiGHS solve", 1.0,
         lambda: _ctrl_c_latency(_CTRL_C_HIGHS)),
    ]
    rows = []
    for name, what, target, run in cases:
        runs = [run() for _ in range(ns.repeat)]
        med = statistics.median(runs)
        rows.append({"case": name, "what": what, "seconds": [round(s, 3) for s in runs],
                     "median_s": round(med, 3), "target_s": target, "met": med <= target})
        print(f"{name:28s} median {med:7.3f} s  target {target:5.1f} s  "
              f"{'met' if med <= target else 'MISSED'}", flush=True)
    doc = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "load_average": os.getloadavg(), "python": platform.python_version()},
           "rows": rows}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
