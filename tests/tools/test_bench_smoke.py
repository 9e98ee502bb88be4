"""Smoke run of the side-by-side benchmark: tiny model, two budgets, one iteration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hrockmate.bench import (  # noqa: E402
    METHODS,
    BenchConfig,
    ModelSpec,
    ModelUnavailable,
    format_table,
    load_zoo,
    run,
)


def _tiny_mlp(size: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """Three residual-free MLP blocks and a head; the blocks are what checkpointing wraps."""
    nn = torch.nn
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
              for _ in range(3)]
    model = nn.Sequential(nn.Linear(16, 64), *blocks, nn.Linear(64, 4))
    return model, torch.randn(64, 16)


TINY = ModelSpec(
    name="mlp",
    description="tiny MLP",
    build=_tiny_mlp,
    blocks=lambda model: list(model)[1:-1],
)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    cfg = BenchConfig(budgets=(1.0, 0.6), iterations=1, size="tiny", threads=1,
                      checkmate_time_limit=15.0, solve_time_limit=15.0, plot=True, echo=False)
    run([TINY], cfg, out, command="test")
    return out


@pytest.fixture(scope="module")
def report(out_dir: Path) -> dict:
    return json.loads((out_dir / "bench.json").read_text())


def test_json_has_every_method_with_measurements(report: dict) -> None:
    (res,) = report["models"]
    assert res["name"] == "mlp" and res["store_all_peak_bytes"] > 0
    points = res["points"]
    for method in METHODS:
        mine = [p for p in points if p["method"] == method]
        assert mine, f"no entry for {method}"
        ok = [p for p in mine if p["status"] == "ok"]
        assert ok, f"{method} produced no measurement: {mine}"
        for p in ok:
            assert p["peak_bytes"] > 0 and p["time_s"] > 0
            assert p["grad_match"] in ("exact", "close", "differ")
            assert isinstance(p["overhead"], float)


def test_hrockmate_within_budget_with_exact_gradients(report: dict) -> None:
    (res,) = report["models"]
    hr = [p for p in res["points"] if p["method"] == "hrockmate"]
    assert sorted(p["budget_fraction"] for p in hr) == [0.6, 1.0]
    for p in hr:
        assert p["status"] == "ok", p
        assert p["peak_bytes"] <= p["budget_bytes"], p
        assert p["grad_match"] == "exact"
    # the benchmark plans as HRockmate does: a hierarchy for each leaf size solve_graph tries
    # (the later ones within the improvement window: on a loaded machine only the first ones)
    from types import SimpleNamespace

    from hrockmate.planning.hierarchy import leaf_sizes

    shape = SimpleNamespace(num_ops=res["hrockmate"]["ops"])  # all leaf_sizes reads
    built = tuple(res["hrockmate"]["leaf_sizes"])
    assert built and built == leaf_sizes(shape, None)[:len(built)]  # type: ignore[arg-type]
    # the 60% plan really recomputes and saves memory against plain autograd
    low = next(p for p in hr if p["budget_fraction"] == 0.6)
    assert low["recomputed_ops"] > 0
    assert low["peak_bytes"] <= 0.6 * res["store_all_peak_bytes"]


def test_selection_per_budget(report: dict) -> None:
    (res,) = report["models"]
    rows = {r["fraction"]: r for r in res["by_budget"]}
    assert set(rows) == {1.0, 0.6}
    for frac, row in rows.items():
        assert set(row["methods"]) == set(METHODS)
        for method, i in row["methods"].items():
            if i is not None:
                p = res["points"][i]
                assert p["method"] == method and p["peak_bytes"] <= row["budget_bytes"]
    # plain autograd fits its own peak and nothing below it
    assert rows[1.0]["methods"]["plain"] is not None
    assert rows[0.6]["methods"]["plain"] is None


def test_checkpoint_keeps_gradients_and_saves_memory(report: dict) -> None:
    (res,) = report["models"]
    ckpt = [p for p in res["points"] if p["method"] == "checkpoint"]
    assert len(ckpt) >= 2  # several subsets of the blocks
    assert all(p["grad_match"] == "exact" for p in ckpt)
    assert min(p["peak_bytes"] for p in ckpt) < res["store_all_peak_bytes"]


def test_plot_and_table(out_dir: Path, report: dict) -> None:
    png = out_dir / "mlp.png"
    assert png.is_file() and 0 < png.stat().st_size < 200_000
    table = format_table(report)
    assert "| 60% | hrockmate |" in table and "| 100% | plain | store-all |" in table


def test_zoo_entries_build_or_explain() -> None:
    zoo = load_zoo()
    for name in ("gpt2", "unet", "encdec", "resnet_bn", "densenet", "mlp_mixer"):
        model, sample = zoo[name].build("tiny")
        assert len(zoo[name].blocks(model)) >= 2, name
    for name in ("hf_gpt2", "hf_t5"):
        try:
            model, sample = zoo[name].build("tiny")
        except ModelUnavailable as exc:
            assert "transformers" in str(exc)
        else:
            assert len(zoo[name].blocks(model)) >= 1
            # the model runs at the library's defaults with its own sample, a finite loss
            assert torch.isfinite(model(**sample)), name
    with pytest.raises(ValueError, match="unknown size"):
        zoo["gpt2"].build("huge")


def test_runtime_overhead_bench_on_the_zoo(tmp_path: Path) -> None:
    """``benches/runtime_overhead.py --zoo``: hrockmate at 100% of store-all against eager on
    a zoo model, with the forward call's host time of each."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benches" / "runtime_overhead.py"
    spec = importlib.util.spec_from_file_location("runtime_overhead", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "ro.json"
    assert bench.main(["--zoo", "tiny", "--models", "resnet_bn", "--iters", "2", "--warmup", "1",
                       "--threads", "1", "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["model"] == "resnet_bn" and r["ops"] > 0
    for key in ("eager_median_s", "hrockmate_median_s", "eager_forward_host_median_s",
                "hrockmate_forward_host_median_s"):
        assert r[key] > 0, key
    assert r["hrockmate_forward_host_median_s"] < r["hrockmate_median_s"]
    with pytest.raises(SystemExit):
        bench.main(["--zoo", "tiny", "--models", "no_such_model", "--out", str(out)])


def test_lowest_budgets_bench(tmp_path: Path) -> None:
    """``benches/lowest_budgets.py``: the lowest peak of the hierarchy's own plans against
    block and selective checkpointing's and Rotor's, as fractions of store-all, in JSON."""
    import importlib.util
    import sys

    from graph_builders import gated_chain

    folder = tmp_path / "graphs"
    folder.mkdir()
    gated_chain(16).save(folder / "gated.json")
    benches = Path(__file__).resolve().parents[2] / "benches"
    sys.path.insert(0, str(benches))
    try:
        spec = importlib.util.spec_from_file_location("lowest_budgets",
                                                      benches / "lowest_budgets.py")
        assert spec is not None and spec.loader is not None
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        out = tmp_path / "lowest.json"
        assert bench.main(["--no-test-graphs", "--graphs", str(folder), "--time-limit", "20",
                           "--out", str(out)]) == 0
    finally:
        sys.path.remove(str(benches))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["graph"] == "gated" and row["store_all_peak"] > 0
    assert 0 < row["hierarchy"] <= row["checkpoint"] < row["store_all_peak"]
    assert row["at_or_below"] is True
