"""The ``hrockmate`` command line: help of every subcommand, a solve, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hrockmate.cli import main

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
