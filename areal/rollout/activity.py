"""The embedded server's lane of the timeline: generate, pause and load spans (areal.events).

    /generate in, out      -> request_started / request_finished
    /pause_generation      -> paused        (ends the generate span, opens a pause span)
    /continue_generation   -> continued     (closes the pause span; generating again if
                                             requests are waiting)
    /update_weights_from_disk -> loading(v) (a load span, inside the pause when interruptible;
                                             abort_all_requests pauses around it itself)

A server is "generating" while it holds at least one request and is not paused: one span
from the first request in to the last out, not one per request, so a busy server records
a handful of lines per weight version whatever its batch size. Requests resubmitted during
a pause wait in the server; they count only once it continues. Called from the event loop's
thread only (the aiohttp handlers), so it needs no lock. Versions are the DecodeEngine's
integers (the server parsed the wire's strings with sglang_api.parse_weight_version).

DecodeMeter is the engine's side (its decode thread): `decode` spans, each a window of
consecutive decode steps with what they computed (steps, rows, context cells, prefilled
tokens, threads), so that a step's cost can be fitted against its rows and context
afterwards (areal/planner/calibrate.py) without a line per step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from areal import events


class ServerActivity:
    def __init__(self, version: Callable[[], int | None]):
        self._version = version  # the weights the server holds now
        self._in_flight = 0
        self._generate_start: float | None = None
        self._pause_start: float | None = None

    def request_started(self) -> None:
        self._in_flight += 1
        if self._in_flight == 1 and self._pause_start is None:
            self._generate_start = time.time()

    def request_finished(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._end_generate()

    def paused(self) -> None:
        self._end_generate()
        if self._pause_start is None:
            self._pause_start = time.time()

    def continued(self) -> None:
        if self._pause_start is not None:
            events.record("pause", self._pause_start, time.time(), version=self._version())
            self._pause_start = None
        if self._in_flight > 0 and self._generate_start is None:
            self._generate_start = time.time()

    @contextlib.contextmanager
    def loading(self, version: int | None, interrupting: bool = False) -> Iterator[None]:
        """A load span. An interrupting load (abort_all_requests) pauses the server around
        it, unless a /pause_generation already has; a non-interruptible one loads without a
        pause (its requests have drained)."""
        own_pause = interrupting and self._pause_start is None
        if own_pause:
            self.paused()
        try:
            with events.span("load", version=version):
                yield
        finally:
            if own_pause:
                self.continued()

    def _end_generate(self) -> None:
        if self._generate_start is not None:
            events.record("generate", self._generate_start, time.time(), version=self._version())
            self._generate_start = None


class DecodeMeter:
    """Sums the decode steps of one engine into `decode` spans: a window closes after
    WINDOW_S, when the threads change, or when the engine paused between two steps (a gap
    over GAP_S: idle, waiting for requests or weights), so that a window's length is the
    cost of its steps. Costs a few additions a step and a line every WINDOW_S at most."""

    WINDOW_S = 0.25
    GAP_S = 0.005

    def __init__(self) -> None:
        self._start = self._end = 0.0
        self._threads = 0
        self._sums = [0, 0, 0, 0, 0, 0]  # steps, rows, cells, read, prefilled tokens and rows

    def step(
        self, start: float, end: float, rows: int, cells: int, read: int, prefill: int,
        prefill_rows: int, threads: int,
    ) -> None:  # fmt: skip
        """One decode step from `start` to `end` (time.time()): `rows` requests whose
        contexts hold `cells` tokens in all, of which attention read `read` cells (its
        chunks' rows x widths, areal/rollout/chunks.py), `prefill` tokens of `prefill_rows`
        of them prefilled first, on `threads` torch threads."""
        if self._sums[0] and (
            threads != self._threads or start - self._end > self.GAP_S
            or end - self._start > self.WINDOW_S
        ):  # fmt: skip
            self.flush()
        if not self._sums[0]:
            self._start, self._threads = start, threads
        self._end = end
        for i, v in enumerate((1, rows, cells, read, prefill, prefill_rows)):
            self._sums[i] += v

    def flush(self) -> None:
        if self._sums[0]:
            steps, rows, cells, read, prefill, prefill_rows = self._sums
            events.record(
                "decode", self._start, self._end, steps=steps, rows=rows, cells=cells,
                read=read, prefill=prefill, prefill_rows=prefill_rows, threads=self._threads,
            )  # fmt: skip
            self._sums = [0] * 6
