"""The ``hrockmate`` command line: help of every subcommand, a solve, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hrockmate.cli import main
from hrockmate.ir.budget import format_bytes
from hrockmate.ir.graph import Graph
from hrockmate.ir.plan import load_plan

SUBCOMMANDS = ("demo", "solve", "simulate", "bench")


def test_every_subcommand_is_listed_and_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    top = capsys.readouterr().out
    for cmd in SUBCOMMANDS:
        assert cmd in top
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: hrockmate {cmd}")
        assert "--" in text  # documents its options


def test_bench_help_names_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for flag in ("--models", "--budgets", "--iterations", "--out", "--methods", "--size"):
        assert flag in text


def test_solve_a_shared_graph(data_graphs: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc = main(["solve", str(data_graphs / "vgg_like_train.json"), "--budget", "0.9",
               "--time-limit", "30", "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "predicted peak" in text and "predicted time" in text
    plan = json.loads(out.read_text())
    # the plan is within the budget it states and below the store-all peak
    assert 0 < plan["peak_bytes"] <= plan["budget_bytes"] < plan["baseline_peak_bytes"]


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("hrockmate: error: ")
    assert "Traceback" not in captured.err
    return lines[0]


def test_bad_graph_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no_such_graph.json"
    line = _one_line_error(capsys, ["solve", str(missing), "--budget", "0.5"])
    assert "no_such_graph.json" in line


def test_bad_budget(data_graphs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, ["solve", str(data_graphs / "vgg_like_train.json"),
                                    "--budget", "lots"])
    assert "lots" in line and "budget" in line


def test_budget_below_the_minimum_states_it(data_graphs: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, ["solve", str(data_graphs / "vgg_like_train.json"),
                                    "--budget", "1000", "--time-limit", "30"])
    assert "smallest feasible peak" in line


def test_bench_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, ["bench", "--models", "no_such_model", "--no-plot"])
    assert "no_such_model" in line and "gpt2" in line  # names the choices
    line = _one_line_error(capsys, ["bench", "--budgets", "1.5", "--models", "gpt2"])
    assert "1.5" in line
    line = _one_line_error(capsys, ["bench", "--methods", "plain,magic", "--models", "gpt2"])
    assert "magic" in line


def test_bench_missing_zoo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, ["bench", "--zoo", str(tmp_path / "zoo.py")])
    assert "zoo.py" in line


def test_bench_lists_the_zoo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("gpt2", "unet", "encdec", "resnet_bn", "densenet", "mlp_mixer", "hf_gpt2",
                 "hf_t5"):
        assert name in out


def test_truth_table_is_a_subcommand(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``hrockmate truth-table --out F`` writes the table of ``hrockmate.truth`` to F."""
    import hrockmate.truth

    asked: list[object] = []
    monkeypatch.setattr(hrockmate.truth, "truth_table",
                        lambda **kw: asked.append(kw) or [])
    assert main(["truth-table", "--out", str(tmp_path / "t.json")]) == 0
    assert asked == [{"out": tmp_path / "t.json", "echo": True}]


def test_parser_is_built_without_importing_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; from hrockmate.cli import build_parser; build_parser(); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_solve_with_solvers_per_level(data_graphs: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc = main(["solve", str(data_graphs / "resnet_like_train.json"), "--budget", "0.5",
               "--solvers", "top=rotor", "-o", str(out)])
    assert rc == 0
    plan = json.loads(out.read_text())
    assert plan["stats"]["solvers"]["top"] == "rotor"
    assert plan["peak_bytes"] <= plan["budget_bytes"]
    capsys.readouterr()  # the solve's progress bar
    line = _one_line_error(capsys, ["solve", str(data_graphs / "vgg_like_train.json"),
                                    "--budget", "0.9", "--solvers", "chains"])
    assert "LEVEL=SOLVER" in line
    line = _one_line_error(capsys, ["solve", str(data_graphs / "vgg_like_train.json"),
                                    "--budget", "0.9", "--solvers", "chains=magic"])
    assert "magic" in line and "rotor" in line


# ---- budgets: one grammar in every command ------------------------------------------------

def test_budget_one_is_the_store_all_peak_in_solve(data_graphs: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``--budget 1`` means 100% in ``solve`` as in ``bench``, not one byte."""
    out = tmp_path / "plan.json"
    assert main(["solve", str(data_graphs / "vgg_like_train.json"), "--budget", "1",
                 "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["budget_bytes"] == plan["baseline_peak_bytes"] == plan["peak_bytes"]


def test_budget_not_a_fraction_nor_whole_bytes(data_graphs: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, ["solve", str(data_graphs / "vgg_like_train.json"),
                                    "--budget", "1.5"])
    assert "1.5" in line and "not a whole number" in line and "(0, 1]" in line


def test_bench_budgets_use_the_same_grammar(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, ["bench", "--budgets", "1,6GiB", "--models", "gpt2"])
    assert "'6GiB'" in line and "size in bytes" in line


def test_too_small_byte_budget_fails_at_once_naming_the_minimum(
        data_graphs: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import highspy

    models: list[object] = []
    real = highspy.Highs

    def counted() -> object:
        models.append(real())
        return models[-1]

    monkeypatch.setattr(highspy, "Highs", counted)
    line = _one_line_error(capsys, ["solve", str(data_graphs / "resnet_like_train.json"),
                                    "--budget", "2"])
    # no solver ran: the graph's cheap lower bound refused the budget
    assert models == []
    from hrockmate.ir.schedule import peak_lower_bound

    graph = Graph.load(data_graphs / "resnet_like_train.json")
    floor, _why = peak_lower_bound(graph)
    assert f"at least {floor} bytes" in line and "alone needs" in line


@pytest.mark.parametrize("flag", ["--time-limit", "--improve-time"])
@pytest.mark.parametrize("limit", ["-1", "0", "nan", "inf", "soon"])
def test_time_limit_must_be_positive_seconds(data_graphs: Path, limit: str, flag: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["solve", str(data_graphs / "vgg_like_train.json"), "--budget", "0.9",
              f"{flag}={limit}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "seconds above 0" in err and repr(limit) in err


def test_improve_time_reaches_the_solver(data_graphs: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import hrockmate

    seen: list[object] = []
    solve_graph = hrockmate.solve_graph

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs.get("improve_time", "default"))
        return solve_graph(*args, **kwargs)

    monkeypatch.setattr(hrockmate, "solve_graph", spy)
    path = str(data_graphs / "vgg_like_train.json")
    assert main(["solve", path, "--budget", "0.9", "--improve-time", "2.5"]) == 0
    assert main(["solve", path, "--budget", "0.9"]) == 0
    assert seen == [2.5, "default"]


def test_solve_prints_a_lower_bound_when_asked(data_graphs: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import re

    import hrockmate

    path = data_graphs / "resnet_like_train.json"
    assert main(["solve", str(path), "--budget", "0.5", "--bound"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("lower bound"))
    bound = float(re.search(r"overhead ([0-9.]+)%", line).group(1))  # type: ignore[union-attr]
    planned = float(re.search(r"overhead ([0-9.]+)%\)", out).group(1))  # type: ignore[union-attr]
    expected = hrockmate.time_lower_bound(hrockmate.Graph.load(path), 0.5).overhead
    assert bound == pytest.approx(100 * expected, abs=0.05) and bound <= planned + 0.05


# ---- simulate reads the plan files solve writes ----------------------------------------------

def test_simulate_a_plan_written_by_solve(data_graphs: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    graph_file = data_graphs / "vgg_like_train.json"
    out = tmp_path / "plan.json"
    assert main(["solve", str(graph_file), "--budget", "0.9", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(graph_file), "--schedule", str(out)]) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert f"peak         {format_bytes(plan['peak_bytes'])}" in text
    # a plan made for another graph is refused, naming both hashes
    line = _one_line_error(capsys, ["simulate", str(data_graphs / "resnet_like_train.json"),
                                    "--schedule", str(out)])
    assert plan["graph_hash"] in line and "solve again" in line


# ---- reports -------------------------------------------------------------------------------

def test_solve_a_graph_whose_ops_take_no_time(data_graphs: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    graph = Graph.load(data_graphs / "vgg_like_train.json")
    for op in graph.ops:
        op.time = 0.0
    graph_file, out = tmp_path / "timeless.json", tmp_path / "plan.json"
    graph.save(graph_file)
    assert main(["solve", str(graph_file), "--budget", "0.9", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted time   0 units" in text and "solve time" in text
    assert "no overhead" in text and f"plan written to  {out}" in text
    plan = load_plan(out, graph)
    assert plan.time == plan.baseline_time == 0 and plan.peak_bytes <= plan.budget_bytes



# ---- the zoo: built in, or named explicitly ----------------------------------------------------

_HOSTILE_ZOO = """
from pathlib import Path
Path(__file__).with_name("EXECUTED").write_text("the zoo in the current directory ran")
"""


def test_bench_never_runs_a_zoo_from_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import hrockmate.bench as bench
    from hrockmate.zoo import ZOO

    (tmp_path / "benches").mkdir()
    (tmp_path / "benches" / "zoo.py").write_text(_HOSTILE_ZOO)
    monkeypatch.chdir(tmp_path)
    # as installed from a wheel: no benches/ folder beside the package
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "site-packages" / "hrockmate" /
                                               "bench.py"))
    assert main(["bench", "--models", "list"]) == 0
    assert not (tmp_path / "benches" / "EXECUTED").exists()
    out = capsys.readouterr().out
    assert all(name in out for name in ZOO)
    assert bench.load_zoo() is ZOO


def test_bench_loads_a_zoo_named_with_zoo(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "my_zoo.py"
    mine.write_text(
        "from hrockmate.bench import ModelSpec\n"
        "ZOO = {'mine': ModelSpec('mine', 'my own model', lambda size: None, lambda m: [])}\n")
    assert main(["bench", "--zoo", str(mine), "--models", "list"]) == 0
    assert "my own model" in capsys.readouterr().out
    # the checkout's benches/zoo.py still serves scripts and --zoo
    repo_zoo = Path(__file__).resolve().parents[2] / "benches" / "zoo.py"
    assert main(["bench", "--zoo", str(repo_zoo), "--models", "list"]) == 0
    assert "mlp_mixer" in capsys.readouterr().out


def test_ctrl_c_stops_a_solve_with_exit_130(data_graphs: Path, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    # the hierarchy takes several seconds on this operator log; SIGINT arrives during it
    proc = subprocess.Popen(
        [sys.executable, "-m", "hrockmate", "solve", str(data_graphs / "gpt2_tiny_oplog.json"),
         "--budget", "0.5", "-o", str(tmp_path / "plan.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**__import__("os").environ, "HROCKMATE_CACHE_DIR": "off"},
        # a test run started in the background inherits SIGINT ignored; a terminal's is not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(1.5)  # imports and parsing take about 1 s, the solve several more
    proc.send_signal(signal.SIGINT)
    # (exit status 130 is the interrupt's: a solve that ran to its end exits 0, one that
    # failed 2; the timeout only keeps a hung solve from hanging the tests)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "hrockmate: interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()


def test_demo_runs_with_the_threads_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from hrockmate.demo import run_demo

    before = torch.get_num_threads()
    try:
        out = run_demo(n_layer=1, n_embd=32, seq=16, batch=2, budget=0.7, iterations=1,
                       threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    printed = capsys.readouterr().out
    assert "threads   1 torch CPU threads" in printed
    assert out["gradients_identical"] and out["hrockmate_peak_bytes"] <= out["budget_bytes"]
    # the budget shown is the one asked for (70% of store-all), and the prediction the runtime's
    assert out["budget_bytes"] >= 0.69 * out["eager_peak_bytes"]
    assert abs(out["hrockmate_peak_bytes"] - out["predicted_peak_bytes"]) <= 64
    # the lower bound printed is never above the prediction
    assert "no schedule within this budget is predicted faster" in printed
    assert 0.0 <= out["lower_bound_overhead"] <= out["predicted_overhead"] + 1e-9
    with pytest.raises(ValueError, match="threads must be >= 1"):
        run_demo(threads=0)
