"""LayerDrop regions: what each of a step's random decisions (``torch.rand([]) < p``, then an
``if`` on it) leaves out when it goes the other way, found by tracing the other outcome and
matching it against the traced step (the matching itself is ``capture.decisions``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from hrockmate.capture.decisions import (
    MIN_DERIVED_RUN,
    DecisionError,
    SkippableRegion,
    SkipRules,
    cache_key,
    check_skipped,
    check_together,
    derive_between,
    regions_from_json,
    regions_to_json,
    skipped_part,
)
from hrockmate.capture.joint import Traced, TraceError
from hrockmate.capture.values import Decision
from hrockmate.progress import Progress

__all__ = ["skippable_regions"]

logger = logging.getLogger(__name__)


def skippable_regions(traced: Traced, decided: list[Decision], first_test: int,
                       trace_not_taken: Callable[[set[int]], Traced],
                       cache: Any = None) -> list[SkippableRegion]:
    """What each random decision of the step leaves out when it goes the other way: the step
    traced again per decision with that one not taken, matched against ``traced`` (every
    decision taken), and once with none taken to check them together
    (``capture.decisions``). In a run of at least ``MIN_DERIVED_RUN`` decisions made at one
    line (a stack of layers), only the first two and the last two are traced alone; the
    others are derived from the second and the last but one (``derive_between``) and checked
    by one trace with every other decision of the run not taken (else traced alone).
    ``cache``: where an earlier finding for the same graph and code is kept
    (``load_decisions`` / ``save_decisions`` of ``hrockmate.planning.cache``)."""
    where = ", ".join(dict.fromkeys(d.where or "the model's code" for d in decided))
    key = cache_key(traced, [d.where or "" for d in decided]) if cache is not None else None
    if key is not None:
        cached = cache.load_decisions(key, lambda data: regions_from_json(
            data, traced, len(decided)))
        if cached is not None:
            logger.info("the model's %d random decisions (%s): what each leaves out is "
                        "cached", len(decided), where)
            return cached
    logger.info("the model decides at random %d times whether to run parts of the step (%s); "
                "tracing each decision's other outcome", len(decided), where)
    n = len(decided)
    made = [(i, traced.output_ids[first_test + i], d.answer, d.where or "the model's code")
            for i, d in enumerate(decided)]
    # Runs of decisions made at one line (a stack of layers): the inner ones are derived
    # from the second and the last but one, then checked by a trace with every other one
    # of the run skipped.
    runs: dict[str, list[int]] = {}
    for i, d in enumerate(decided):
        runs.setdefault(d.where or "", []).append(i)
    derived_runs = [r for r in runs.values() if len(r) >= MIN_DERIVED_RUN]
    inner = {i for r in derived_runs for i in r[2:-2]}
    found: dict[int, SkippableRegion] = {}
    bar = Progress(n - len(inner) + bool(derived_runs) + (n > 1),
                   f"tracing the other outcome of {n} random decisions of "
                   f"'{traced.graph.name}'", True)

    def trace_alone(i: int) -> None:
        found[i] = skipped_part(traced, trace_not_taken({i}), *made[i])
        bar.update()

    try:
        for i in range(n):
            if i not in inner:
                trace_alone(i)
        alternate: set[int] = set()
        derived: set[int] = set()  # (the decisions whose regions were derived)
        for r in derived_runs:
            got = derive_between(traced, found[r[1]], found[r[-2]], len(r) - 3,
                                 [made[i] for i in r[2:-2]])
            if got is None:
                logger.info("the layers deciding at %s are not alike: tracing each of them",
                            made[r[0]][3])
                bar.add(len(r) - 4)
                for i in r[2:-2]:
                    trace_alone(i)
                continue
            found.update((g.index, g) for g in got)
            derived.update(g.index for g in got)
            alternate.update(r[0::2])
        if derived_runs and not alternate:
            bar.add(-1)  # (no check trace)
        regions = [found[i] for i in range(n)]
        rules = SkipRules.of(traced, regions)
        if alternate:
            try:
                check_skipped(traced, trace_not_taken(alternate), rules, alternate)
            except DecisionError as exc:
                logger.info("regions derived for alike layers do not hold (%s): tracing each "
                            "of them", exc)
                bar.add(len(derived))
                for i in sorted(derived):
                    trace_alone(i)
                regions = [found[i] for i in range(n)]
                rules = SkipRules.of(traced, regions)
            bar.update()
        if len(regions) > 1:
            check_together(traced, trace_not_taken(set(range(n))), rules)
            bar.update()
    except DecisionError as exc:
        raise TraceError(
            f"the model decides at random whether to run parts of the step (at {where}), and "
            f"hrockmate cannot tell what the other outcome leaves out: {exc}. Turn that "
            "randomness off (transformers models: set the config's layerdrop, "
            "encoder_layerdrop and decoder_layerdrop to 0.0) or leave this module out of "
            "hrockmate") from exc
    finally:
        bar.close()
    for r in regions:
        logger.debug("decision %d at %s: %d ops skipped when it goes the other way",
                     r.index, r.where, len(r.ops))
    if key is not None:
        cache.save_decisions(key, regions_to_json(regions))
    return regions


# ---- IR construction ----------------------------------------------------------------------------
