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
from pathlib import Path

from tqdm import tqdm

from areal.loggers import MetricSink

ETA_WINDOW = 20
"""Steps over which the time per step is averaged (recent speed, not the warm-up's)."""


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
