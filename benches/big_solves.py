"""Solve times of graphs of 8-9k ops: Hugging Face Mamba and Jamba on their slow torch path.

Both models run their selective scan as a Python loop over the sequence when the CUDA kernels
are missing (CPU), so a few layers trace to thousands of small ops, most of them repeated
layers and repeated scan steps. Each graph is traced once (``--graphs-dir`` keeps it), then
solved at each budget in a fresh process (so that no cached least peak or hierarchy carries
over from one solve to the next), and the CPU time of the solve (``time.process_time``, all
threads) is recorded with the plan's predicted overhead, or the refusal's least budget.

The refusal budgets lie between the graph's floor (``peak_lower_bound``, refused before any
search) and the least peak the planner reaches, so that they exercise the search and the
least-peak computation.

``--pythonpath DIR`` solves with another checkout's ``python`` folder (to compare with the
code before a change; its ``hrockmate/_native.abi3.so`` must be there); ``--label`` names the
run in the JSON, which keeps the runs of other labels already in the file.

    OMP_NUM_THREADS=1 HROCKMATE_CACHE_DIR=off python benches/big_solves.py --label after
    OMP_NUM_THREADS=1 HROCKMATE_CACHE_DIR=off python benches/big_solves.py --label before \\
        --pythonpath /path/to/main/python

``--whole`` times the whole ``HRockmate(model, sample, budget)`` instead (trace, op times,
block options, solve, compile; a fresh process per budget, the model built as above), as a
user's build or refusal costs it.

Writes ``benches/results/big_solves.json`` (after every case).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: name -> (model family, layers, sequence length, refusal budgets as fractions of store-all):
#: about the sizes of the issue's graphs (Mamba 8,549 ops, Jamba 9,260), those of
#: ``benches/program_cost.py``'s defaults
MODELS: dict[str, tuple[str, int, int, tuple[float, ...]]] = {
    "mamba": ("mamba", 4, 61, (0.15,)),
    "jamba": ("jamba", 8, 56, (0.12,)),
}
VOCAB = 256
BATCH = 2


def build(family: str, layers: int) -> Any:
    """The model, small widths (the op count depends on layers and sequence length only)."""
    import torch

    torch.manual_seed(0)
    if family == "mamba":
        from transformers import MambaConfig, MambaForCausalLM

        return MambaForCausalLM(MambaConfig(
            vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=layers, expand=2,
            conv_kernel=4, use_cache=False))
    from transformers import JambaConfig, JambaForCausalLM

    return JambaForCausalLM(JambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False,
        use_cache=False))


def traced_graph(name: str, graphs_dir: Path) -> Path:
    """The graph file of ``name``, traced (op times measured on this CPU) unless kept."""
    family, layers, seq, _ = MODELS[name]
    path = graphs_dir / f"{family}_L{layers}_s{seq}.json"
    if path.exists():
        return path
    import torch

    import hrockmate

    model = build(family, layers)
    ids = torch.randint(0, VOCAB, (BATCH, seq))
    graph = hrockmate.trace(model, {"input_ids": ids, "labels": ids}, loss_fn="loss")
    graphs_dir.mkdir(parents=True, exist_ok=True)
    graph.save(path)
    return path


CHILD = r"""
import json, sys, time, warnings
from hrockmate.ir.graph import Graph
from hrockmate.ir.plan import InfeasibleBudget
from hrockmate.planning.api import solve_graph
graph = Graph.load(sys.argv[1])
fraction = float(sys.argv[2])
t0, w0 = time.process_time(), time.perf_counter()
row = {}
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = solve_graph(graph, fraction, progress=False)
    row.update(status="plan", overhead=plan.overhead, peak_ratio=plan.memory_ratio,
               made_by=plan.made_by, leaf_size=plan.stats.get("leaf_size"),
               blocks=plan.stats.get("blocks"), solved_blocks=plan.stats.get("solved_blocks"))
except InfeasibleBudget as exc:
    row.update(status="refused", min_bytes=exc.min_bytes, proven=exc.proven_minimum)
row.update(cpu_s=round(time.process_time() - t0, 2), wall_s=round(time.perf_counter() - w0, 2))
print("ROW " + json.dumps(row))
"""


WHOLE_CHILD = r"""
import json, sys, time, warnings
sys.path.insert(0, sys.argv[1])
import torch
from big_solves import BATCH, MODELS, VOCAB, build
from hrockmate import HRockmate
from hrockmate.ir.plan import InfeasibleBudget
family, layers, seq, _ = MODELS[sys.argv[2]]
fraction = float(sys.argv[3])
model = build(family, layers)
ids = torch.randint(0, VOCAB, (BATCH, seq))
t0, w0 = time.process_time(), time.perf_counter()
row = {}
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HRockmate(model, {"input_ids": ids, "labels": ids}, budget=fraction,
                       loss_fn="loss", progress=False)
    row.update(status="plan", overhead=hm.plan.overhead, made_by=hm.plan.made_by,
               ops=hm.traced.graph.num_ops)
except InfeasibleBudget as exc:
    row.update(status="refused", min_bytes=exc.min_bytes, proven=exc.proven_minimum)
row.update(cpu_s=round(time.process_time() - t0, 2), wall_s=round(time.perf_counter() - w0, 2))
print("ROW " + json.dumps(row))
"""


def solve_in_child(path: Path, fraction: float, pythonpath: str) -> dict[str, Any]:
    return _child([CHILD, str(path), str(fraction)], pythonpath)


def build_in_child(name: str, fraction: float, pythonpath: str) -> dict[str, Any]:
    return _child([WHOLE_CHILD, str(REPO / "benches"), name, str(fraction)], pythonpath)


def _child(args: list[str], pythonpath: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1",
               HROCKMATE_CACHE_DIR="off")
    out = subprocess.run([sys.executable, "-c", *args], env=env,
                         capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    return {"status": "error", "stderr": out.stderr[-2000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba,jamba")
    ap.add_argument("--budgets", default="0.7,0.5,0.3")
    ap.add_argument("--label", default="after")
    ap.add_argument("--pythonpath", default=str(REPO / "python"),
                    help="the python folder whose hrockmate solves (default: this checkout's)")
    ap.add_argument("--graphs-dir", default=str(Path(tempfile.gettempdir()) / "big_solves"))
    ap.add_argument("--out", default=str(REPO / "benches" / "results" / "big_solves.json"))
    ap.add_argument("--whole", action="store_true",
                    help="time the whole HRockmate(model, sample, budget) per budget")
    args = ap.parse_args(argv)
    out = Path(args.out)
    doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    doc.setdefault("runs", {})
    doc["note"] = ("CPU seconds (time.process_time, all threads) of one solve_graph call each "
                   "(runs whose 'measures' is 'HRockmate(...)': of the whole constructor), "
                   "a fresh process per solve, OMP_NUM_THREADS=1, plan cache off; graphs "
                   f"traced once (batch {BATCH}, vocabulary {VOCAB}, hidden size 64, measured "
                   "op times). The machine was shared with other work, so wall times are "
                   "noisy and CPU times less so.")
    rows: list[dict[str, Any]] = []
    # (each run names its models: runs of other labels may be of other sizes)
    doc["runs"][args.label] = {
        "pythonpath": args.pythonpath,
        "measures": "HRockmate(...)" if args.whole else "solve_graph",
        "models": {name: {"family": f, "layers": L, "seq": s, "refusal_budgets": list(r)}
                   for name, (f, L, s, r) in MODELS.items()},
        "rows": rows}
    for name in args.models.split(","):
        fractions = [float(b) for b in args.budgets.split(",") if b] + list(MODELS[name][3])
        if args.whole:
            ops = None
        else:
            from hrockmate.ir.graph import Graph

            path = traced_graph(name, Path(args.graphs_dir))
            ops = Graph.load(path).num_ops
        for fraction in fractions:
            found = (build_in_child(name, fraction, args.pythonpath) if args.whole
                     else solve_in_child(path, fraction, args.pythonpath))
            ops = found.pop("ops", None) or ops  # (a refusal has no graph: its build's)
            row = {"model": name, "ops": ops, "budget": fraction, **found}
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
