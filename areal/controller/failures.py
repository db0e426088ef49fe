"""When episodes only fail, the run stops and says why, instead of retrying forever.

    controller: episode rejected ──► FailureWatch.rejected(error) ──► report? ──► NoProgress
                episode accepted ──► FailureWatch.accepted()            (the run ends, exit
                                                                         NO_PROGRESS_EXIT)

A rejected episode's prompt is drawn again, which is right for a failure now and then (a
flaky tool, a timeout) and wrong when every episode fails the same way (a workflow that
raises, an endpoint that refuses its requests): the run would sit with no step and no
message. Either rule ends it: `max_consecutive` rejections in a row, or `window_s` seconds
of rejections without one accepted episode. A declined episode (the workflow returned None)
is neither. The report holds the first error's traceback, usually the most telling, and
the latest error.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

NO_PROGRESS_EXIT = 3
"""The controller's exit code for a run that cannot make progress: the launcher stops the
run with the report instead of recovering it (a restart would fail the same way)."""
REPORT_MARK = "areal: the run cannot make progress"


class NoProgress(RuntimeError):
    """Episodes only fail; the message is the report for the console."""


class FailureWatch:
    def __init__(
        self, max_consecutive: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.max_consecutive = max_consecutive
        self.window_s = window_s
        self.clock = clock
        self.consecutive = 0
        self.first: BaseException | None = None
        self.first_at = 0.0
        """When the first rejection since the last accepted episode happened."""

    def accepted(self) -> None:
        self.consecutive = 0
        self.first = None

    def rejected(self, error: BaseException) -> str | None:
        """The report, if this rejection ends the run; else None."""
        now = self.clock()
        if self.first is None:
            self.first, self.first_at = error, now
        self.consecutive += 1
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            why = (
                f"the last {self.consecutive} episodes were all rejected "
                f"(rollout.max_consecutive_failures={self.max_consecutive})"
            )
        elif self.window_s and now - self.first_at >= self.window_s:
            why = (
                f"every episode for {now - self.first_at:.0f} s was rejected, "
                f"{self.consecutive} of them (rollout.failure_window_s={self.window_s:g})"
            )
        else:
            return None
        first = "".join(traceback.format_exception(self.first)).rstrip()
        latest = f"{type(error).__name__}: {error}"
        return (
            f"{REPORT_MARK}: {why}.\nThe first error:\n{first}\nThe latest: {latest}\n"
            "Fix what the error says (the workflow, rollout.workflow; its endpoint calls), or "
            "set rollout.max_consecutive_failures=0 and rollout.failure_window_s=0 to retry "
            "rejected prompts forever."
        )
