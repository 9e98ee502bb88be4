"""Bounded work (docs/graph-ir.md, "Limits"; docs/literature-solvers.md): schedules and tables
that would not fit are refused with errors naming their size, long native calls and HiGHS
solves stop at their time limit or on Ctrl-C, and byte sums are exact or refused.

These tests assert the mechanism (which error, which stop reason, that a call returned while
the work it abandoned was still running), not wall-clock seconds, which flake on a loaded
machine; ``benches/bounds.py`` measures how long each stop takes and writes JSON."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from highs_standins import HighsStandIn

import hrockmate
from hrockmate import _native
from hrockmate.ir.graph import Graph, GraphError, Op, Tensor
from hrockmate.ir.plan import InfeasibleBudget
from hrockmate.ir.schedule import (
    Schedule,
    ScheduleError,
    recompute_all_schedule,
    simulate,
    store_all_schedule,
)
from hrockmate.planning import literature

REPO = Path(__file__).resolve().parents[2]


def training_chain(n: int, nbytes: int = 1000) -> Graph:
    """n forward ops a_{i-1} -> a_i (a_0 the input, a_n the output), then n backward ops
    (g_i, a_{i-1}) -> g_{i-1} (g_n the tangent, g_0 the input's gradient): a chain of n stages."""
    g = Graph(f"chain{n}", time_unit="units")
    g.tensors.append(Tensor("x", nbytes, "input"))
    for i in range(1, n + 1):
        g.tensors.append(Tensor(f"a{i}", nbytes, "output" if i == n else "activation"))
    g.tensors.append(Tensor("dy", nbytes, "tangent"))
    grad = {n: n + 1}
    for i in range(n - 1, -1, -1):
        grad[i] = len(g.tensors)
        g.tensors.append(Tensor(f"g{i}", nbytes, "input_grad" if i == 0 else "activation",
                                grad_of=0 if i == 0 else None))
    for i in range(1, n + 1):
        g.ops.append(Op(f"f{i}", "forward", 1.0, [i - 1], [i]))
    for i in range(n, 0, -1):
        g.ops.append(Op(f"b{i}", "backward", 2.0, [grad[i], i - 1], [grad[i - 1]],
                        differentiates=i - 1))
    return g


# What the Python code run in a subprocess starts with.
PRELUDE = f"""
import json, resource, sys, time
sys.path[:0] = [{str(REPO / "tests" / "planning")!r}, {str(REPO / "tests")!r}]
from test_bounds import training_chain
def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
"""


def python_command(code: str) -> list[str]:
    return [sys.executable, "-c", PRELUDE + textwrap.dedent(code)]


def run_python(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(python_command(code), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


# ---- item 1: recompute-all refuses n^2 schedules -----------------------------------------------

def test_recompute_all_of_a_200k_op_chain_is_refused_quickly_in_little_memory() -> None:
    r = run_python("""
        from hrockmate.ir.schedule import recompute_all_schedule
        g = training_chain(100_000)
        before = peak_rss_mb()
        try:
            recompute_all_schedule(g)
            out = {"error": None}
        except MemoryError as exc:
            out = {"error": type(exc).__name__, "message": str(exc)}
        out.update(rss_before=before, rss_after=peak_rss_mb())
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["error"] == "TooLargeError"
    assert "recompute-all on this graph (200000 ops, 100000 of them backward) would take more " \
           "than 20000000 steps" in out["message"]
    # Counting the steps first allocates nothing that grows with them (the schedule alone
    # would take ~80 GB).
    assert out["rss_after"] - out["rss_before"] < 200, out


def test_recompute_all_still_plans_small_graphs() -> None:
    g = training_chain(50)
    s = recompute_all_schedule(g)
    sim = simulate(g, s)
    assert sim.peak_bytes < simulate(g, store_all_schedule(g)).peak_bytes


# ---- item 2: Rotor's tables and time -----------------------------------------------------------

def test_rotor_on_a_10k_stage_chain_is_refused_with_the_sizes_named() -> None:
    g = training_chain(10_000)
    with pytest.raises(_native.TooLargeError) as info:
        literature.rotor(g, 10**9)
    assert isinstance(info.value, MemoryError)
    assert "Rotor on 10000 stages needs 9.50 GiB for its tables even with 16 memory slots " \
           "(more than the 1.00 GiB allowed" in str(info.value)
    # A larger bound is the caller's to give; a tiny one refuses smaller chains too.
    with pytest.raises(_native.TooLargeError, match="Rotor on 100 stages needs"):
        literature.rotor(training_chain(100), 10**9, max_table_bytes=10_000)


def test_rotor_reduces_its_slots_to_fit_max_table_bytes() -> None:
    stages = [literature.ChainStage(1.0, 100, 100, 0, [literature.StateOption(1.0, 200, 0, 2.0, 0)])
              for _ in range(60)]
    full = literature.rotor_chain(stages, 3_000)
    assert full.slots == 500
    small = literature.rotor_chain(stages, 3_000, max_table_bytes=2**20)
    assert 16 <= small.slots < 500 and small.peak_bytes <= 3_000


def test_rotor_on_a_2k_op_chain_returns_at_its_time_limit() -> None:
    g = training_chain(1_000)  # 2,000 ops, 1,000 stages: minutes without a limit
    # (the native solver says it stopped at its limit: it polled the clock, not ran out)
    with pytest.raises(_native.TimeLimitError, match=r"stopped at the time limit \(2 s\)"):
        literature.rotor(g, 20_000, time_limit=2, max_table_bytes=2**28)


def test_time_limits_are_checked() -> None:
    g = training_chain(5)
    for bad in (-1, float("nan"), float("inf"), "3"):
        with pytest.raises(ValueError, match="time_limit"):
            literature.rotor(g, 10**6, time_limit=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="time_limit"):
            literature.twremat(g, time_limit=bad)  # type: ignore[arg-type]
    with pytest.raises(_native.TimeLimitError):
        literature.twremat(training_chain(3_000), time_limit=0)


def test_solve_graph_gives_rotor_the_time_left() -> None:
    g = training_chain(1_000)
    # The baseline and the recompute-all fallback come first; Rotor gets what is left (without
    # the limit it runs for minutes) and says it stopped there.
    with pytest.raises(TimeoutError, match="stopped at the time limit"):
        hrockmate.solve_graph(g, 0.3, method="rotor", time_limit=3, progress=False)


def test_checkmate_refuses_a_milp_too_large_for_its_time_limit(caplog: pytest.LogCaptureFixture
                                                                  ) -> None:
    # 600 ops: an op-level MILP of ~3M nonzeros, whose build and HiGHS set-up alone take over
    # 15 s and do not poll the time limit; it ran 44 s under a 5 s limit before this check
    g = training_chain(300)
    with caplog.at_level("WARNING", logger="hrockmate"), pytest.warns(UserWarning):
        plan = hrockmate.solve_graph(g, 0.1, method="checkmate", time_limit=5, progress=False)
    assert plan.stats["fallback"] and plan.peak_bytes <= plan.budget_bytes
    assert any("nonzeros" in r.getMessage() and "time_limit" in r.getMessage()
               for r in caplog.records), caplog.text


def test_a_milp_past_the_size_cap_is_refused_naming_its_size(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    from hrockmate.planning import ilp

    monkeypatch.setattr(ilp, "MAX_MODEL_NONZEROS", 10_000)
    level = ilp.op_level(training_chain(40))
    with pytest.raises(ilp.LevelNoSolution, match=r"about [\d,]+ nonzeros.*hierarchically"):
        ilp.solve_level(level.problem, None)


def test_run_highs_stops_at_its_deadline() -> None:
    from hrockmate.planning.ilp import run_highs

    h = _hard_knapsack()  # its own time_limit is 120 s
    assert run_highs(h, deadline=time.perf_counter() + 1.0) == "deadline"
    assert h.modelStatusToString(h.getModelStatus()) == "Interrupted by user"


def test_run_highs_stops_a_search_that_stopped_improving() -> None:
    """With ``stall``, a MIP whose best schedule has stopped improving is stopped, keeping that
    schedule, long before its own limit; a deadline still wins when it comes first."""
    from hrockmate.planning.ilp import run_highs

    h = _hard_knapsack()  # its own time_limit is 120 s and it runs well past 10 s
    why = run_highs(h, deadline=time.perf_counter() + 60.0, stall=0.5)
    assert why == "stall"
    assert h.getInfo().primal_solution_status == 2  # the best schedule found is kept
    h = _hard_knapsack()
    assert run_highs(h, deadline=time.perf_counter() + 0.3, stall=60.0) == "deadline"


def test_run_highs_stops_soon_once_the_gap_is_small() -> None:
    """A best schedule within ``CLOSE_GAP`` of the bound that has not improved for
    ``CLOSE_GAP_STALL_SECONDS`` ends the search, even with a long ``stall``."""
    from hrockmate.planning import ilp

    h = _hard_knapsack()  # runs well past 30 s; its gap falls under 0.5% within seconds
    why = ilp.run_highs(h, deadline=time.perf_counter() + 60.0, stall=30.0)
    assert why == "stall"
    assert h.getInfo().mip_gap <= ilp.CLOSE_GAP
    assert h.getInfo().primal_solution_status == 2


# ---- item 3: Ctrl-C ----------------------------------------------------------------------------

def interrupt_after_start(code: str, wait: float = 1.0) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``code`` (which prints "started" when the long call begins), send SIGINT ``wait``
    seconds later; the finished process and the seconds it took to exit after the signal
    (``benches/bounds.py`` records them)."""
    # a test run started in the background inherits SIGINT ignored, and Python then installs
    # no KeyboardInterrupt handler: the child gets the default disposition back
    p = subprocess.Popen(python_command(code), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=REPO,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "started"
    time.sleep(wait)
    sent = time.perf_counter()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), time.perf_counter() - sent


def _hard_knapsack() -> object:
    """A HiGHS model of a 0-1 knapsack in 10 dimensions: many seconds of branch and bound."""
    import highspy
    import numpy as np

    rng = np.random.default_rng(0)
    n, m = 100, 10
    w = rng.integers(1000, 10000, size=(m, n)).astype(float)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("time_limit", 120.0)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, m
    lp.col_cost_ = -rng.integers(1000, 10000, size=n).astype(float)
    lp.col_lower_, lp.col_upper_ = np.zeros(n), np.ones(n)
    lp.row_lower_, lp.row_upper_ = np.full(m, -highspy.kHighsInf), w.sum(axis=1) / 2
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.arange(0, m * n + 1, n)
    lp.a_matrix_.index_ = np.tile(np.arange(n), m)
    lp.a_matrix_.value_ = w.ravel()
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n
    h.passModel(lp)
    return h


def test_ctrl_c_stops_a_native_rotor_call() -> None:
    done, _ = interrupt_after_start("""
        from hrockmate.planning import literature
        g = training_chain(1_000)
        print("started", flush=True)
        literature.rotor(g, 20_000, max_table_bytes=2**27)
        print("finished")
    """)
    assert "KeyboardInterrupt" in done.stderr and "finished" not in done.stdout, done.stderr


def test_ctrl_c_stops_a_highs_solve() -> None:
    done, _ = interrupt_after_start("""
        from hrockmate.planning.ilp import run_highs
        from test_bounds import _hard_knapsack
        h = _hard_knapsack()
        print("started", flush=True)
        run_highs(h)
        print("finished", h.modelStatusToString(h.getModelStatus()))
    """)
    assert "KeyboardInterrupt" in done.stderr and "finished" not in done.stdout, done.stderr
    assert "terminate called" not in done.stderr


class _DeafHighs(HighsStandIn):
    """A HiGHS stand-in in a phase that polls no interrupt callback (a sub-MIP heuristic):
    ``run`` goes on, whatever it is told, until the test releases it."""

    def __init__(self) -> None:
        import threading

        super().__init__()
        self.release = threading.Event()
        self.running = False

    def run(self) -> None:
        self.running = True
        self.release.wait(60.0)
        self.running = False


def test_ctrl_c_returns_within_the_grace_when_highs_does_not_poll() -> None:
    import _thread
    import threading

    from hrockmate.planning import ilp

    h = _DeafHighs()
    timer = threading.Timer(0.3, _thread.interrupt_main)
    # interrupt_main does nothing while SIGINT is ignored (a test run started in the background)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ilp.run_highs(h)
        # returned after the grace while the run it abandoned still goes on
        assert h.running
        assert h.cbMipInterrupt.attached  # left for the abandoned run to stop at its next poll
    finally:
        h.release.set()
        timer.join()
        signal.signal(signal.SIGINT, before)
    # a cancellation from another thread (the block solvers' way) returns as soon
    event = threading.Event()
    threading.Timer(0.3, event.set).start()
    deaf = _DeafHighs()
    try:
        with ilp.cancelled_by(event), pytest.raises(ilp.SolveCancelled):
            ilp.run_highs(deaf)
        assert deaf.running
    finally:
        deaf.release.set()


def test_blocks_go_lean_when_the_time_left_would_not_do(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """When the blocks would not all be solved in their share of the time limit at the pace
    so far, the rest get fewer options (leaves: the Rust core's fronts) and the hierarchy still
    makes the plan. The pace is forced here (any deadline looks too close)."""
    from graph_builders import training_graph

    from hrockmate.planning import hierarchy

    monkeypatch.setattr(hierarchy, "LEAN_MARGIN", 1e12)
    monkeypatch.setattr(hierarchy, "LEAN_SAMPLE", 5)
    g = training_graph(120, 3)
    h = hierarchy.prepare(g, flat_ops=0, leaf_size=3, progress=False, workers=1,
                          time_limit=600)
    assert h.lean
    counts = h.solver_counts()
    assert counts.get("rust", 0) >= 1 and counts.get("ilp", 0) >= 5
    st = hierarchy._Settings(None, 1.0, 1e-4)
    st.go_lean()
    full = hierarchy._Settings(None, 1.0, 1e-4)
    uppers = [b for b in h.root.children if b.children]
    assert uppers
    for b in uppers:  # a lean block solves its fastest, keep-nothing and lowest-peak options
        assert len(hierarchy._block_options(h.ctx, b, st)) <= 3
        assert len(hierarchy._block_options(h.ctx, b, full)) >= 1
    plan = hrockmate.solve_graph(g, 0.5, hierarchy=h, progress=False, time_limit=600)
    assert plan.peak_bytes <= plan.budget_bytes
    assert plan.stats["lean_blocks"]
    # the hierarchy made a plan of its own (a simple strategy may still beat it)
    assert not plan.stats.get("fallback") or plan.stats.get("beats_hierarchy_plan")


def test_ctrl_c_stops_every_thread_solving_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hierarchy's blocks are solved in threads; Ctrl-C reaches only the main thread, which
    cancels the other threads' HiGHS solves: all of them stop within a second."""
    import os
    import threading

    from graph_builders import training_graph

    from hrockmate.planning import hierarchy as planner
    from hrockmate.planning import ilp

    started = threading.Semaphore(0)
    outcomes: list[str] = []

    def hard_options(ctx: object, block: object, st: object) -> list[object]:
        started.release()
        try:
            ilp.run_highs(_hard_knapsack())  # 120 s of branch and bound unless cancelled
        except ilp.SolveCancelled:
            outcomes.append("cancelled")
            raise
        outcomes.append("finished")
        raise AssertionError("the solve was not cancelled")

    monkeypatch.setattr(planner, "_block_options", hard_options)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        def interrupt() -> None:
            for _ in range(2):  # both threads are solving
                started.acquire(timeout=30)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        g = training_graph(16, 9)
        with pytest.raises(KeyboardInterrupt):
            planner.prepare(g, flat_ops=0, leaf_size=3, progress=False, workers=2)
        # the threads' solves were cancelled, none ran to its end (a hang guard only: the
        # knapsacks run for minutes uncancelled)
        for t in threading.enumerate():
            if t.name.startswith("hrockmate-blocks"):
                t.join(timeout=60.0)
        assert not any(t.name.startswith("hrockmate-blocks") for t in threading.enumerate())
        assert outcomes and set(outcomes) == {"cancelled"}, outcomes
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_cancelled_solve_stops_within_a_second() -> None:
    import threading

    from hrockmate.planning import ilp

    cancel = threading.Event()
    outcome: list[BaseException | None] = []

    def solve() -> None:
        try:
            with ilp.cancelled_by(cancel):
                ilp.run_highs(_hard_knapsack())
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    worker = threading.Thread(target=solve)
    worker.start()
    time.sleep(0.5)
    cancel.set()
    worker.join(timeout=60.0)  # a hang guard: uncancelled, the knapsack runs for minutes
    assert not worker.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ilp.SolveCancelled)


# ---- item 4: byte sums -------------------------------------------------------------------------

def _graph_json(out_bytes: int) -> str:
    return json.dumps({
        "format": "hrockmate-graph", "version": 1, "name": "big",
        "tensors": [{"name": "x", "bytes": 8, "role": "input"},
                    {"name": "h", "bytes": out_bytes, "role": "activation"},
                    {"name": "y", "bytes": out_bytes, "role": "output"}],
        "ops": [{"name": "f", "phase": "forward", "time": 1.0, "inputs": [0], "outputs": [1]},
                {"name": "g", "phase": "forward", "time": 1.0, "inputs": [1], "outputs": [2]}],
    })


def test_sizes_past_int64_are_refused_when_the_graph_is_read() -> None:
    for size in (2**63, 2**64 - 1):
        with pytest.raises(GraphError, match=r"tensor 1 'h': field 'bytes': expected an integer "
                                             r">= 0 \(at most 2\^63-1\)"):
            Graph.from_json(_graph_json(size))


def test_byte_sums_are_exact_or_refused() -> None:
    # Two tensors of 2^62 would take an int64 sum of their bytes past 2^63: refused, naming the
    # tensor at which the sizes pass the bound.
    with pytest.raises(GraphError, match=r"tensor 1 'h': field 'bytes': is 4611686018427387904, "
                                         r"which takes the graph's sizes past 2\^62-1 bytes"):
        Graph.from_json(_graph_json(2**62))
    g = Graph.from_json(_graph_json(2**61 - 8))
    sim = simulate(g, store_all_schedule(g))
    assert sim.peak_bytes == 2 * (2**61 - 8)
    assert int(sim.timeline.min()) >= 0


def test_schedule_ids_past_int64_are_out_of_range() -> None:
    text = json.dumps({"format": "hrockmate-schedule", "version": 1, "forward_len": 0,
                       "steps": [["compute", 2**63]]})
    with pytest.raises(ValueError, match=r"step 0: id 9223372036854775808 is out of range") as info:
        Schedule.from_json(text)
    assert "negative" not in str(info.value) and ">= 0;" not in str(info.value)
    with pytest.raises(ValueError, match=r"schedule step 0: id 9223372036854775808 is out of range"):
        Schedule([("compute", 2**63)], 0)


# ---- item 5: native exception classes and the stub ---------------------------------------------

def test_native_errors_have_their_own_classes() -> None:
    bases = {
        "InvalidGraphError": ValueError, "InvalidScheduleError": ValueError,
        "InvalidArgumentError": ValueError, "NotAChainError": ValueError,
        "InfeasibleError": ValueError, "TooLargeError": MemoryError,
        "TimeLimitError": TimeoutError, "InternalError": RuntimeError,
    }
    for name, base in bases.items():
        cls = getattr(_native, name)
        assert issubclass(cls, base) and cls.__module__ == "hrockmate._native", name
    g = training_chain(4)
    arrays = g.to_arrays()
    kind, ids, forward_len = _native.store_all(**arrays)
    with pytest.raises(_native.InvalidScheduleError) as info:
        _native.simulate(kind[1:], ids[1:], forward_len - 1, **arrays)
    assert info.value.step == 0 and str(info.value).startswith("step 0: compute op 1")
    with pytest.raises(ScheduleError) as wrapped:
        simulate(g, Schedule([("compute", 1)], 0))
    assert wrapped.value.step == 0
    with pytest.raises(_native.InfeasibleError) as infeasible:
        _native.rotor(budget_bytes=10, **arrays)
    assert infeasible.value.limit_bytes == 10 and infeasible.value.min_bytes > 10
    with pytest.raises(InfeasibleBudget) as budget:
        literature.rotor(g, 10)
    assert budget.value.min_bytes == infeasible.value.min_bytes
    arrays["op_in_idx"] = arrays["op_in_idx"] + 1000
    with pytest.raises(_native.InvalidGraphError, match="out of range"):
        _native.check_graph(**arrays)


def test_the_stub_lists_every_native_name() -> None:
    stub = ast.parse((REPO / "python" / "hrockmate" / "_native.pyi").read_text())
    declared = {node.name for node in stub.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    declared |= {node.target.id for node in stub.body
                 if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    exported = {name for name in dir(_native) if not name.startswith("_")} | {"__version__"}
    assert declared == exported
