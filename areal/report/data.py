"""What a report plots, read from a run directory: plain series, no matplotlib.

    {run}/metrics.jsonl  -> reward, staleness max, throughput per step (and its run time)
    {run}/batches.jsonl  -> per-sample staleness and output lengths of each step
    {run}/events/*.jsonl -> spans per lane (server k, trainer rank r, controller)

Every figure draws only what these functions return, so testing them against the files
tests what the pictures show.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from areal.events import read_events

LENGTH_PERCENTILES = (50, 90, 99)


class NotARunError(ValueError):
    """The directory given is not (yet) a run's experiment directory."""


@dataclass
class Span:
    kind: str
    start: float  # seconds since the timeline's origin
    end: float
    version: int | None
    lent: int = 0  # a borrow span's shares borrowed from waiting roles (areal/cores.py)


@dataclass
class Run:
    path: Path
    label: str
    metrics: list[dict]
    batches: list[dict]
    events: list[dict]
    """The spans of work (`cpu` samples are in `cpu`)."""
    max_staleness: int | None = None
    config: dict = field(default_factory=dict)
    cpu: list[dict] = field(default_factory=list)
    """Each role process's CPU samples (events.py's `cpu` records)."""


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written, or cut by a crash
            continue
    return rows


def load_run(path: str | Path) -> Run:
    """The run at `path`; NotARunError saying why when it is not one."""
    path = Path(path)
    if not path.is_dir():
        raise NotARunError(f"{path} is not a directory")
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.exists():
        raise NotARunError(
            f"{path} is not a run directory: it has no metrics.jsonl. Give the experiment "
            "directory of a run, {fileroot}/{experiment_name}/{trial_name} (printed as "
            "'areal: experiment directory ...' when the run starts)"
        )
    metrics = [m for m in _read_jsonl(metrics_path) if "step" in m]
    if not metrics:
        raise NotARunError(f"{path} has no finished training step yet: nothing to report")
    config: dict = {}
    if (path / "config.yaml").exists():
        import yaml

        config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    label = "/".join(str(config.get(k)) for k in ("experiment_name", "trial_name") if config.get(k))
    events = read_events(path)
    return Run(
        path=path,
        label=label or path.name,
        metrics=metrics,
        batches=_read_jsonl(path / "batches.jsonl"),
        events=[e for e in events if e["kind"] != "cpu"],
        max_staleness=config.get("max_staleness"),
        config=config,
        cpu=[e for e in events if e["kind"] == "cpu"],
    )


# ---- per-step series ----------------------------------------------------------------------


def series(run: Run, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, run time in seconds, values) of one metrics.jsonl key, steps that have it."""
    rows = [m for m in run.metrics if key in m]
    return (
        np.array([m["step"] for m in rows]),
        np.array([m["time"] for m in rows], dtype=float),
        np.array([m[key] for m in rows], dtype=float),
    )


def smooth(values: np.ndarray, window: int = 10) -> np.ndarray:
    """Trailing mean over up to `window` steps (the first points average what there is)."""
    cum = np.cumsum(np.insert(values.astype(float), 0, 0.0))
    n = np.arange(1, len(values) + 1)
    lo = np.maximum(n - window, 0)
    return (cum[n] - cum[lo]) / (n - lo)


def staleness_counts(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """(steps, counts[step, s]): how many samples of each step's batch had staleness s."""
    if not run.batches:
        return np.array([], dtype=int), np.zeros((0, 1), dtype=int)
    top = max(max(b["staleness"], default=0) for b in run.batches)
    width = max(top, run.max_staleness or 0) + 1
    counts = np.zeros((len(run.batches), width), dtype=int)
    for i, b in enumerate(run.batches):
        counts[i] = np.bincount(b["staleness"], minlength=width)
    return np.array([b["step"] for b in run.batches]), counts


def output_lengths(run: Run) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """(steps, {"p50"|"p90"|"p99"|"max": per step}, every sample's length over the run)."""
    steps = np.array([b["step"] for b in run.batches], dtype=int)
    per_step: dict[str, np.ndarray] = {
        f"p{q}": np.array([np.percentile(b["output_len"], q) for b in run.batches])
        for q in LENGTH_PERCENTILES
    }
    per_step["max"] = np.array([max(b["output_len"]) for b in run.batches], dtype=float)
    every = np.array([n for b in run.batches for n in b["output_len"]], dtype=int)
    return steps, per_step, every


# ---- the timeline -------------------------------------------------------------------------


def lane_order(name: str) -> tuple[int, int]:
    """Servers first, then trainer ranks, then the controller (the paper's Figure 3 puts
    generation above training); by index within a role."""
    role = name.rstrip("0123456789")
    index = int(name[len(role) :] or 0)
    return ({"server": 0, "trainer": 1, "controller": 2}.get(role, 3), index)


def origin(run: Run) -> float:
    """The timeline's zero: the earliest recorded span."""
    return min(e["start"] for e in run.events)


def lanes(run: Run) -> dict[str, list[Span]]:
    """Spans per lane (role process), in lane order, times relative to `origin`."""
    if not run.events:
        return {}
    t0 = origin(run)
    out: dict[str, list[Span]] = {}
    for e in run.events:
        out.setdefault(e["role"], []).append(
            Span(e["kind"], e["start"] - t0, e["end"] - t0, e.get("version"), e.get("lent", 0))
        )
    return {name: out[name] for name in sorted(out, key=lane_order)}


def version_marks(run: Run) -> list[tuple[int, float]]:
    """(version, time it was published), from trainer rank 0's publish spans."""
    if not run.events:
        return []
    t0 = origin(run)
    return [
        (e["version"], e["end"] - t0)
        for e in run.events
        if e["kind"] == "publish" and e["role"] == "trainer0"
    ]


def time_shares(spans: list[Span]) -> dict[str, float]:
    """Share of a lane's extent (first start to last end) covered by each kind (a borrow
    span overlaps the work it speeds up)."""
    if not spans:
        return {}
    extent = max(s.end for s in spans) - min(s.start for s in spans)
    shares: dict[str, float] = {}
    for s in spans:
        shares[s.kind] = shares.get(s.kind, 0.0) + (s.end - s.start) / max(extent, 1e-9)
    return shares


def waiting_share(lane: str, spans: list[Span]) -> float:
    """Share of the lane's time spent waiting: a trainer for its batch; a server for
    anything but generating (no request, paused, loading)."""
    shares = time_shares(spans)
    if lane.startswith("trainer"):
        return shares.get("wait_batch", 0.0)
    if lane.startswith("server"):
        return max(0.0, 1.0 - shares.get("generate", 0.0))
    return float("nan")


WORK_KINDS = {
    "server": ("generate", "load"),
    "trainer": (
        "proximal",
        "reference",
        "values",
        "update",
        "critic_update",
        "publish",
        "checkpoint",
    ),
}
"""The spans in which a lane computes; anything else (no span, waiting for a batch, paused or
held by the staleness bound) is idle."""


def idle_while_busy_share(lanes_: dict[str, list[Span]]) -> float:
    """Share of the run in which a server or trainer lane is idle, its core not lent (a
    `borrow` span of a peer), while another computes: the time a core could have moved to
    the role with work (issue 28's yardstick). Counted from when every such lane has
    started to when the first one ends (start-up and shut-down are not a steady state);
    NaN with fewer than two such lanes. It counts lanes, as if each had a core or more:
    with more such roles than cores, an idle lane need not leave a core idle."""
    busy: dict[str, list[tuple[float, float]]] = {}
    for name, spans in lanes_.items():
        work = WORK_KINDS.get(name.rstrip("0123456789"))
        if work is not None and spans:
            busy[name] = [(s.start, s.end) for s in spans if s.kind in work]
    if len(busy) < 2:
        return float("nan")
    start = max(min(s.start for s in lanes_[n]) for n in busy)
    end = min(max(s.end for s in lanes_[n]) for n in busy)
    if end <= start:
        return float("nan")
    # Sweep the merged busy intervals of every lane and the borrow spans: (time, lanes at
    # work, shares lent).
    edges: list[tuple[float, int, int]] = []

    def add(a: float, b: float, working: int, lent: int) -> None:
        a, b = max(a, start), min(b, end)
        if a < b:
            edges.extend([(a, working, lent), (b, -working, -lent)])

    for name, intervals in busy.items():
        merged: list[list[float]] = []
        for a, b in sorted(intervals):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        for a, b in merged:
            add(a, b, 1, 0)
        for s in lanes_[name]:
            if s.kind == "borrow":
                add(s.start, s.end, 0, s.lent)
    idle, working, lent, t = 0.0, 0, 0, start
    for time, d_working, d_lent in sorted(edges):
        if 0 < working and len(busy) - working > lent:
            idle += time - t
        working, lent, t = working + d_working, lent + d_lent, time
    return idle / (end - start)


# ---- the summary --------------------------------------------------------------------------


def cores_used(run: Run) -> dict[str, float]:
    """Each role process's mean cores (CPU seconds a second, all its threads) from its first
    published version on, start-up left out; {} where the run sampled no CPU."""
    published = [e["end"] for e in run.events if e["kind"] == "publish"]
    since = min(published, default=-math.inf)
    used: dict[str, list[float]] = {}
    for e in run.cpu:
        if e["start"] >= since and e["end"] > e["start"]:
            cpu, wall = used.setdefault(e["role"], [0.0, 0.0])
            used[e["role"]] = [cpu + e["cpu_s"], wall + e["end"] - e["start"]]
    return {
        r: cpu / wall for r, (cpu, wall) in sorted(used.items(), key=lambda x: lane_order(x[0]))
    }


SMOOTH_STEPS = 10
"""Steps whose mean reward the summary gives as the run's final reward: one batch's mean is
noisy (a tiny run's swings by several points from step to step)."""


def summary(run: Run) -> dict:
    """The figures `python -m areal.report` prints for a run."""
    _, _, reward = series(run, "reward/mean")
    _, _, tput = series(run, "throughput/train_tokens_per_s")
    best = int(np.argmax(reward))
    return {
        "label": run.label,
        "steps": int(run.metrics[-1]["step"]),
        "time_s": float(run.metrics[-1]["time"]),
        "final_reward": float(reward[-1]),
        "smoothed_steps": min(SMOOTH_STEPS, len(reward)),
        "smoothed_final_reward": float(np.mean(reward[-SMOOTH_STEPS:])),
        "best_reward": float(reward[best]),
        "best_step": int(run.metrics[best]["step"]),
        "median_train_tokens_per_s": float(np.median(tput)) if len(tput) else float("nan"),
        "waiting": {name: waiting_share(name, s) for name, s in lanes(run).items()},
        "idle_while_busy": idle_while_busy_share(lanes(run)),
        "cores": cores_used(run),
    }


def format_summary(s: dict) -> str:
    lines = [
        f"{s['label']}: {s['steps']} steps in {s['time_s']:.1f}s",
        f"  reward: {s['smoothed_final_reward']:+.2f} (mean of the last {s['smoothed_steps']} "
        f"steps; the last step's batch alone {s['final_reward']:+.2f}), best "
        f"{s['best_reward']:+.2f} (step {s['best_step']})",
        f"  median training throughput: {s['median_train_tokens_per_s']:.1f} tok/s",
    ]
    waits = [(n, w) for n, w in s["waiting"].items() if w == w]  # NaN: no waiting measure
    if waits:
        lines.append(
            "  time spent waiting: "
            + ", ".join(
                f"{n} {100 * w:.0f}%{' (not generating)' if n.startswith('server') else ''}"
                for n, w in waits
            )
        )
    else:
        lines.append("  time spent waiting: no events recorded (stats.events=false?)")
    if not math.isnan(s["idle_while_busy"]):
        lines.append(
            "  a lane idle, its core not lent, while another computes: "
            f"{100 * s['idle_while_busy']:.0f}% of the run"
        )
    if s.get("cores"):
        lines.append(
            "  cores used (CPU-s a second, after start-up): "
            + ", ".join(f"{n} {c:.2f}" for n, c in s["cores"].items())
        )
    return "\n".join(lines)
