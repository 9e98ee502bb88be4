"""Outputs the caller drops before ``backward()``: planned without their bytes after the forward.

``loss = model(**batch).loss; loss.backward()`` (or ``model(**batch).loss.backward()``) lets
go of every other output (a language model's logits, a cache of keys and values) as soon as
the forward returns. The runtime keeps no reference of its own to an output after the forward
(only those the backward reads are saved), so such an output's memory is gone from then on;
a graph's outputs, though, are never freed by a schedule, so the plan would be charged for
them to the end of the backward.

``HRockmate(..., drop_outputs=True)`` says the caller drops them: the planner then plans on a
copy of the graph in which those outputs are ordinary activations (``planning_graph``), and
the schedule it gets is made one of the traced graph by leaving out their frees
(``traced_schedule``). Its predicted peak is that of the traced graph's schedule with the
dropped outputs freed where the forward ends (``dropped_peak``): alive through the whole
forward, as they are until it returns, gone in the backward unless a step after the forward
reads them (the runtime saves those). A dropped output that shares its storage with tensors
the backward reads (a transformers cache holds views of the keys and values attention's
backward reads) is not saved: the runtime lets go of it with the caller, and the plan frees
and recomputes that storage like any other activation's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from hrockmate.ir.graph import Graph
from hrockmate.ir.schedule import Schedule, SimulationResult, simulate


def droppable_outputs(graph: Graph, output_ids: Sequence[int], with_gradient: set[int]
                      ) -> list[int]:
    """The outputs a caller that keeps only the loss lets go of before backward: those
    without a gradient that no backward op reads (the runtime saves those it reads)."""
    read_in_backward = {x for o in graph.ops if o.phase == "backward" for x in o.inputs}
    return sorted({t for t in output_ids
                   if t not in with_gradient and t not in read_in_backward
                   and graph.tensors[t].role == "output"})


def planning_graph(graph: Graph, dropped: Sequence[int]) -> Graph:
    """``graph`` with the ``dropped`` outputs made activations (a schedule may free them)."""
    drop = set(dropped)
    tensors = [dataclasses.replace(t, role="activation") if i in drop else t
               for i, t in enumerate(graph.tensors)]
    return Graph(graph.name, tensors, graph.ops, graph.time_unit, dict(graph.meta))


def traced_schedule(schedule: Any, dropped: Sequence[int]) -> Schedule:
    """A schedule of ``planning_graph`` as one of the traced graph: without the frees of the
    dropped outputs (outputs are never freed by a schedule; the caller lets go of them)."""
    drop = set(dropped)
    steps, fl = [], 0
    for k, (kind, ident) in enumerate(schedule.steps):
        if kind == "free" and ident in drop:
            continue
        steps.append((kind, ident))
        if k < schedule.forward_len:
            fl += 1
    return Schedule(steps, fl)


def dropped_peak(planning: Graph, schedule: Any, dropped: Sequence[int]) -> SimulationResult:
    """The simulation, on ``planning_graph``, of a schedule of the traced graph with the
    dropped outputs freed where the forward ends: what the step costs when the caller lets
    go of them as the forward returns. An output that a step after the forward reads itself
    (the logits where the schedule makes the loss again) is saved by the runtime for that
    step and stays. One that only shares its storage with tensors read later (a cache's keys
    and values, views of what attention's backward reads) is not held by the runtime: its
    storage lives as long as the schedule keeps those tensors (``saved_positions``)."""
    steps = [(str(k), int(i)) for k, i in schedule.steps]
    fl = int(schedule.forward_len)
    read_back = read_after_forward(planning, steps, fl)
    frees = [("free", t) for t in sorted(set(dropped)) if t not in read_back]
    return simulate(planning, Schedule(steps[:fl] + frees + steps[fl:], fl + len(frees)))


def read_after_forward(graph: Graph, steps: Sequence[tuple[str, int]], forward_len: int
                       ) -> set[int]:
    """The tensors a compute step after the forward segment reads."""
    return {t for kind, k in steps[forward_len:] if kind == "compute"
            for t in graph.ops[k].inputs}


def saved_positions(graph: Graph, schedule: Any, output_ids: Sequence[int],
                    dropped: Sequence[int] = ()) -> list[int]:
    """Positions of the outputs the runtime saves for the backward: those whose storage a
    step after the forward segment reads (the output itself, or a view or detached alias of
    it, such as softmax's result), as autograd saves what a backward reads, so that a caller
    changing one in place fails autograd's version check; of the ``dropped`` outputs, only
    those a later step reads themselves (the caller lets go of the others, and the storage
    they share is kept, while the schedule needs it, by the tensors that read it)."""
    steps = [(str(k), int(i)) for k, i in schedule.steps]
    fl = int(schedule.forward_len)
    read = read_after_forward(graph, steps, fl)
    roots = {graph.storage_root(t) for t in read}
    drop = set(dropped)
    return [j for j, t in enumerate(output_ids)
            if (t in read if t in drop else graph.storage_root(t) in roots)]
