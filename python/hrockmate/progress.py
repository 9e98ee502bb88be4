"""Progress of long work: tqdm bars when tqdm is installed, else log lines every few seconds
(planning's block solves and MILPs, tracing's extra traces of random decisions)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from typing import Any, Iterator

__all__ = ["Progress", "elapsed_progress"]

logger = logging.getLogger("hrockmate")


@contextlib.contextmanager
def elapsed_progress(desc: str, seconds: float | None, enabled: bool) -> Iterator[None]:
    """Show the seconds one long step (a MILP) has run, out of ``seconds`` (its limit, or None),
    from a background thread: a search that finds nothing for a minute still shows that it
    runs and how long it may take. tqdm when it is installed, else log lines every few
    seconds; nothing when not ``enabled``."""
    if not enabled:
        yield
        return
    total = (max(1, math.ceil(seconds)) if seconds is not None and math.isfinite(seconds)
             else None)
    bar: Any = None
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, leave=False,
                   bar_format="{desc}: {n} s" if total is None
                   else "{desc}: {percentage:3.0f}%|{bar}| {n}/{total} s")
    except ImportError:
        pass
    stop = threading.Event()
    t0 = time.perf_counter()

    def tick() -> None:
        last_log = t0
        while not stop.wait(0.5):
            now = time.perf_counter()
            if bar is not None:
                bar.n = int(now - t0) if total is None else min(int(now - t0), total)
                bar.refresh()
            elif now - last_log > 3.0:
                last_log = now
                logger.info("%s: %.0f s%s", desc, now - t0,
                            "" if total is None else f" of at most {total} s")

    ticker = threading.Thread(target=tick, name="hrockmate-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join(1.0)
        if bar is not None:
            bar.close()


class Progress:
    """tqdm when it is installed, else log lines at most every few seconds."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        if enabled and total > 1:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=desc, leave=False)
            except ImportError:
                self.bar = None
        self.enabled = enabled

    def update(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        now = time.perf_counter()
        if self.enabled and now - self.last > 3.0:
            self.last = now
            logger.info("%s: %d/%d (%.0f s)", self.desc, self.n, self.total, now - self.t0)

    def add(self, more: int) -> None:
        """More steps than first said (work found on the way)."""
        self.total += more
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
