"""Write the test graphs under tests/data/graphs/ (run from the repository root).

    python tests/data/make_graphs.py            # synthetic graphs only (no torch needed)
    python tests/data/make_graphs.py --traced   # also re-export the traced built-in models

Two kinds of networkx node-link files, so that every test runs from a clone alone:

- ``*_train.json``: Checkmate-style training graphs made here from a layer list (one node per
  layer, ``X_backward`` differentiates ``X``; ``backward``/``cost_cpu``/``cost_ram`` fields). The
  backward of layer k reads k's output, the outputs of k's consumers and their gradients, which
  is the link pattern of Checkmate's Keras extractor.
- ``*_oplog.json``: operator logs of the built-in models, traced with hrockmate and exported with
  the pairing removed: node names are ``<index>_<aten op>``, only the ``backward`` flag says which
  phase an op belongs to, and views and multi-output ops are folded into one node each. Backward
  ops do not mirror forward ops one to one, as in traces taken by other tools.
- ``random_layered_n60.json``: a random layered DAG (``duration``/``out_cost``/``param_cost``),
  forward only.

All files are deterministic (fixed seeds), so re-running the script rewrites identical files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "graphs"


def _checkmate(name: str, layers: list[tuple[str, list[int], int, int]]) -> dict[str, Any]:
    """Layers as (name, inputs as layer indices, cost, output bytes), in a topological order;
    the last layer feeds the loss."""
    n = len(layers)
    consumers: list[list[int]] = [[] for _ in range(n)]
    for k, (_, ins, _, _) in enumerate(layers):
        for i in ins:
            consumers[i].append(k)
    nodes: list[dict[str, Any]] = []
    links: list[tuple[int, int]] = []
    for k, (lname, ins, cost, out_bytes) in enumerate(layers):
        nodes.append({"name": lname, "backward": False, "cost_cpu": cost,
                      "cost_ram": out_bytes, "id": k})
        links.extend((i, k) for i in ins)
    loss = n
    nodes.append({"name": "Loss", "backward": True, "cost_cpu": layers[-1][2],
                  "cost_ram": 1024, "id": loss})
    links.append((n - 1, loss))
    bwd = {k: n + 1 + (n - 1 - k) for k in range(n)}  # backward nodes in reverse layer order
    for k in reversed(range(n)):
        lname, _, cost, out_bytes = layers[k]
        b = bwd[k]
        nodes.append({"name": f"{lname}_backward", "backward": True,
                      "cost_cpu": max(1, round(cost * 1.1)), "cost_ram": out_bytes, "id": b})
        links.append((k, b))
        if consumers[k]:
            for c in consumers[k]:
                links.append((c, b))
                links.append((bwd[c], b))
        else:
            links.append((loss, b))
    nodes.sort(key=lambda d: d["id"])
    return {"directed": True, "multigraph": False, "graph": {"name": name}, "nodes": nodes,
            "links": [{"source": s, "target": t} for s, t in sorted(set(links))]}


def vgg_like() -> dict[str, Any]:
    """A VGG-style chain: conv blocks of halving resolution, then dense layers (22 layers)."""
    layers: list[tuple[str, list[int], int, int]] = []
    rng = random.Random(16)
    size = 64 * 2**20
    for block, convs in enumerate((2, 2, 3, 3, 3), start=1):
        for c in range(1, convs + 1):
            layers.append((f"block{block}_conv{c}", [len(layers) - 1] if layers else [],
                           rng.randint(300, 450), size))
        # pooling quarters the pixels, the next block doubles the channels (as in VGG)
        layers.append((f"block{block}_pool", [len(layers) - 1], rng.randint(100, 200), size // 4))
        size //= 2
    for lname, b in (("flatten", size // 2), ("fc1", 2**20), ("fc2", 2**20), ("predictions", 2**18)):
        layers.append((lname, [len(layers) - 1], rng.randint(20, 240), b))
    return _checkmate("vgg-like chain, 22 layers", layers)


def resnet_like(blocks: int = 8) -> dict[str, Any]:
    """Residual stages: each block is conv-bn-relu-conv-bn, then add with the block's input."""
    rng = random.Random(50)
    layers: list[tuple[str, list[int], int, int]] = [("stem", [], 400, 32 * 2**20)]
    size = 32 * 2**20
    for b in range(blocks):
        if b and b % 3 == 0:
            size //= 2
        x = len(layers) - 1
        for part in ("conv1", "bn1", "relu1", "conv2", "bn2"):
            cost = rng.randint(200, 400) if part.startswith("conv") else rng.randint(20, 60)
            layers.append((f"res{b}_{part}", [len(layers) - 1], cost, size))
        layers.append((f"res{b}_add", [len(layers) - 1, x], 15, size))
        layers.append((f"res{b}_out", [len(layers) - 1], 15, size))
    layers.append(("pool", [len(layers) - 1], 30, 2**16))
    layers.append(("fc", [len(layers) - 1], 40, 2**12))
    return _checkmate(f"resnet-like, {blocks} residual blocks", layers)


def unet_like(depth: int = 4) -> dict[str, Any]:
    """An encoder-decoder with a long skip per level (FCN/U-Net style)."""
    rng = random.Random(8)
    layers: list[tuple[str, list[int], int, int]] = []
    size = 16 * 2**20
    skips = []
    for d in range(depth):
        for c in (1, 2):
            layers.append((f"down{d}_conv{c}", [len(layers) - 1] if layers else [],
                           rng.randint(200, 400), size))
        skips.append(len(layers) - 1)
        layers.append((f"down{d}_pool", [len(layers) - 1], 50, size // 4))
        size //= 2
    layers.append(("bottom_conv", [len(layers) - 1], 300, size))
    for d in reversed(range(depth)):
        size *= 2
        layers.append((f"up{d}_upsample", [len(layers) - 1], 60, size))
        layers.append((f"up{d}_concat", [len(layers) - 1, skips[d]], 20, 2 * size))
        layers.append((f"up{d}_conv", [len(layers) - 1], rng.randint(200, 400), size))
    layers.append(("head", [len(layers) - 1], 100, size // 8))
    return _checkmate(f"unet-like, depth {depth}", layers)


def random_layered(n: int = 60, seed: int = 3) -> dict[str, Any]:
    """A random layered DAG in the layered node-link form (forward only)."""
    rng = random.Random(seed)
    width = 6
    nodes = []
    links = []
    for i in range(n):
        nodes.append({"name": i, "duration": rng.randint(1, 20), "out_cost": rng.randint(1, 50),
                      "param_cost": rng.choice([0, 0, rng.randint(1, 10)])})
        layer_start = (i // width) * width
        if layer_start:
            prev = range(max(0, layer_start - width), layer_start)
            for s in rng.sample(list(prev), k=min(len(prev), rng.randint(1, 3))):
                links.append({"0": s, "1": i})
    return {"directed": True, "multigraph": False, "graph": {"name": f"random layered n{n}"},
            "nodes": nodes, "links": links}


def oplog(graph: Any) -> dict[str, Any]:
    """A traced hrockmate graph as an operator log: one node per op, the bytes of the storages it
    creates, links from the producers of its inputs, the phase flag and nothing else."""
    producer: dict[int, int] = {}
    for i, op in enumerate(graph.ops):
        for t in op.outputs:
            producer[t] = i
    nodes = []
    links = set()
    for i, op in enumerate(graph.ops):
        own = sum(graph.tensors[t].bytes for t in op.outputs
                  if graph.tensors[t].alias_of is None)
        target = op.target.split(".")[-2] if "." in op.target else (op.target or "op")
        nodes.append({"name": f"{i}_{target}", "backward": op.phase == "backward",
                      "cost_cpu": round(op.time * 1e6, 1), "cost_ram": int(own), "id": i})
        for t in op.inputs:
            if t in producer and producer[t] != i:
                links.add((producer[t], i))
    return {"directed": True, "multigraph": False,
            "graph": {"name": f"{graph.name} operator log (no forward/backward pairing)"},
            "nodes": nodes, "links": [{"source": s, "target": t} for s, t in sorted(links)]}


TRACED = {
    "gpt2_tiny": {},
    "unet_tiny": {},
    "densenet_tiny": {},
    "cnn_bn": {},
    "rnn_loop": {},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traced", action="store_true", help="also re-export the traced models")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    files = {
        "vgg_like_train.json": vgg_like(),
        "resnet_like_train.json": resnet_like(),
        "unet_like_train.json": unet_like(),
        "random_layered_n60.json": random_layered(),
    }
    if args.traced:
        import torch

        import hrockmate
        from hrockmate import models

        torch.manual_seed(0)
        for name, cfg in TRACED.items():
            model, sample = models.build(name, **cfg)
            files[f"{name}_oplog.json"] = oplog(hrockmate.trace(model, sample))
    for fname, data in files.items():
        (OUT / fname).write_text(json.dumps(data, separators=(",", ":")) + "\n")
        print(f"wrote {OUT / fname} ({len(data['nodes'])} nodes)")


if __name__ == "__main__":
    main()
