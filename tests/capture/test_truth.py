"""Truth check: the store-all schedule's simulated peak on a traced graph matches the peak of
plain PyTorch (eager autograd) measured on CPU for the same iteration, within 5%."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

from hrockmate import models
from hrockmate.truth import format_truth_table, truth_row, truth_table

TOLERANCE = 0.05
ROWS: list[dict[str, Any]] = []

class _LSTMSequence(nn.Module):
    """nn.LSTM over a whole sequence: on CPU its oneDNN kernel returns a workspace tensor
    whose size only the real run reveals."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


VARIANTS: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "lstm_sequence": lambda: (_LSTMSequence(), torch.randn(2, 5, 8)),
    "gpt2_logits": lambda: models.gpt2_tiny(with_loss=False, n_layer=1),
    "cnn_bn_wide": lambda: models.cnn_bn(width=16, n_blocks=1, image=24),
    "rnn_loop_rnn": lambda: models.rnn_loop(cell="rnn", steps=10),
}


def _check(row: dict[str, Any]) -> None:
    ROWS.append(row)
    assert row["measured_peak"] > 0
    assert abs(row["error"]) <= TOLERANCE, format_truth_table([row])


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_store_all_peak_matches_eager_peak(name: str) -> None:
    model, sample = models.build(name)
    _check(truth_row(name, model, sample))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_store_all_peak_matches_eager_peak_variants(name: str) -> None:
    model, sample = VARIANTS[name]()
    _check(truth_row(name, model, sample))


def test_store_all_peak_matches_eager_peak_with_loss_fn() -> None:
    model, sample = models.mlp(batch=16, hidden=96)
    target = torch.randint(0, 10, (16,))
    _check(truth_row("mlp_loss_fn", model, sample,
                     loss_fn=lambda out: nn.functional.cross_entropy(out, target)))


def test_truth_table_is_written_as_json(tmp_path: Path) -> None:
    out = tmp_path / "truth.json"
    rows = truth_table(["mlp"], out=out, echo=False)
    data = json.loads(out.read_text())
    assert data["rows"] == rows and rows[0]["model"] == "mlp"
    assert set(rows[0]) == {"model", "ops", "trace_s", "simulated_peak", "measured_peak", "error"}
    print("\n" + format_truth_table(ROWS))  # shown with pytest -s
