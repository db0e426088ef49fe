"""The launcher's console: one line per training step, a progress bar with an ETA, and
each step handed to the metric loggers (areal/loggers.py).

    metrics.jsonl --tail (every launcher.dead_role_poll_s)--> Progress --> console line, bar
                                                                      '--> MetricSink

The ETA comes from the run's own clock (each line's `time`), not from how fast lines are
read, so a resumed run that reads its earlier steps at once still estimates right.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from areal.loggers import MetricSink

ETA_WINDOW = 20
"""Steps over which the time per step is averaged (recent speed, not the warm-up's)."""
NOTICE_S = 2.0
"""A wait before the first step is named once it has lasted this long..."""
REPEAT_S = 30.0
"""...and named again every this many seconds while it lasts."""


class Progress:
    """Tails metrics.jsonl: one console line per training step and a progress bar."""

    def __init__(self, path: Path, total_steps: int, sink: MetricSink | None = None):
        self.path = path
        self.offset = 0
        self.total_steps = total_steps
        self.sink = sink
        self.times: list[tuple[int, float]] = []  # (step, run time) of the lines read
        self.bar = tqdm(
            total=total_steps,
            unit="step",
            dynamic_ncols=True,
            file=sys.stdout,
            disable=None,
            # tqdm's own estimate would count the burst of a resumed run's old lines.
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
        )
        self._closed = False
        self.read = 0
        """Lines read (this launcher's count: a recovery's rewind does not lower it)."""

    def write(self, line: str) -> None:
        """A console line above the progress bar."""
        self.bar.write(line)

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            data = f.read()
        lines = data.split("\n")
        self.offset += len(data) - len(lines[-1])  # a partial last line waits for its end
        for line in lines[:-1]:
            if line.strip():
                m = json.loads(line)
                self.read += 1
                self.times.append((m["step"], m["time"]))
                eta = eta_seconds(self.times, self.total_steps)
                self.bar.write(f"{format_step(m)} | ETA {format_duration(eta)}")
                self.bar.set_postfix_str(f"ETA {format_duration(eta)}", refresh=False)
                self.bar.update(1)
                if self.sink is not None:
                    self.sink.log(m)

    def rewind(self) -> None:
        """After a recovery cut metrics.jsonl back to its checkpoint: go on from there. The
        steps written again reach the loggers again (TensorBoard keeps the newer ones)."""
        text = self.path.read_text() if self.path.exists() else ""
        self.offset = len(text)
        kept = [json.loads(line) for line in text.splitlines() if line.strip()]
        self.times = [(m["step"], m["time"]) for m in kept]
        self.bar.n = len(kept)
        self.bar.refresh()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.bar.close()
        if self.sink is not None:
            self.sink.close()


def eta_seconds(times: list[tuple[int, float]], total_steps: int) -> float:
    """Seconds until `total_steps`, at the mean time per step of the last ETA_WINDOW steps;
    `times` holds (step, seconds since the run started) in step order."""
    step, now = times[-1]
    first_step, first_time = times[max(0, len(times) - 1 - ETA_WINDOW)]
    if first_step == step:  # one line: its run time over its steps is all we know
        first_step, first_time = 0, 0.0
    per_step = (now - first_time) / max(step - first_step, 1)
    return max(total_steps - step, 0) * per_step


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_step(m: dict) -> str:
    return (
        f"step {m['step']:>4} | version {m['version']:>4} | reward {m['reward/mean']:+6.2f} | "
        f"staleness max {m['staleness/max']} | {m['throughput/train_tokens_per_s']:7.1f} tok/s | "
        f"{m['time']:7.1f}s"
    )


class StartWaits:
    """Says what a starting run (or a recovery) waits for before its first step, once a
    wait has lasted NOTICE_S: the roles (a rollout worker registers once its server has
    loaded the model and answers), then the first batch. Silent after the first step."""

    def __init__(
        self,
        registered: Callable[[str, int], bool],
        roles: list[tuple[str, int]],
        first_batch: str,
        write: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.registered, self.roles, self.first_batch = registered, roles, first_batch
        self.write, self.clock = write, clock
        self.begin()

    def begin(self) -> None:
        """A new attempt starts: its roles start again."""
        self.active = True
        self.what: str | None = None
        self.since = self.clock()
        self.said: float | None = None

    def waiting_for(self) -> str:
        starting = [
            f"server{k} to load the model" if role == "rollout" else f"{role}{k} to start"
            for role, k in self.roles
            if not self.registered(role, k)
        ]
        return ", ".join(starting) if starting else self.first_batch

    def poll(self, stepped: bool) -> None:
        if not self.active:
            return
        if stepped:
            self.active = False
            return
        what, now = self.waiting_for(), self.clock()
        phase = "batch" if what == self.first_batch else "roles"
        if phase != self.what:  # the first batch's wait begins (the roles' began with us)
            self.since = self.since if self.what is None else now
            self.what, self.said = phase, None
        if now - self.since >= NOTICE_S and (self.said is None or now - self.said >= REPEAT_S):
            self.write(f"areal: waiting for {what} ({now - self.since:.0f} s so far)")
            self.said = now
