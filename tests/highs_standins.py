"""Stand-ins for a ``highspy.Highs`` object, for testing ``ilp.run_highs`` without HiGHS."""

from __future__ import annotations

from typing import Any, Iterator


class Callbacks:
    """Stands in for a highspy callback list: ``+=`` and ``-=`` attach and detach a callback;
    ``attached`` lists them."""

    def __init__(self) -> None:
        self.attached: list[Any] = []

    def __iadd__(self, fn: Any) -> "Callbacks":
        self.attached.append(fn)
        return self

    def __isub__(self, fn: Any) -> "Callbacks":
        self.attached.remove(fn)
        return self

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self.attached))


class HighsStandIn:
    """The callback lists ``run_highs`` attaches to; subclasses give ``run``."""

    def __init__(self) -> None:
        self.cbSimplexInterrupt = Callbacks()
        self.cbIpmInterrupt = Callbacks()
        self.cbMipInterrupt = Callbacks()
        self.cbMipImprovingSolution = Callbacks()

    def run(self) -> None:
        raise NotImplementedError
