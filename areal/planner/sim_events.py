"""The simulation's clock and events."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventQueue:
    """The simulated clock and its events: each runs at its time, ties in the order they were
    scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self, done: Callable[[], bool], budget: int = 50_000_000) -> None:
        """Run events until `done()` or none is left; `budget` events at most (a deadline
        for a run that could never finish)."""
        while self._events and not done():
            t, _, fn, args = heapq.heappop(self._events)
            self.now = t
            fn(*args)
            budget -= 1
            if budget == 0:
                raise RuntimeError("the simulation did not finish (an internal error)")
