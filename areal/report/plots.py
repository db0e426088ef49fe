"""The report's figures (matplotlib, Agg): each draws series from report/data.py only.

One figure per question, per run: reward.png (against step and wall time), staleness.png
(max and distribution per step), lengths.png (output lengths over the run, and the tail),
throughput.png (over time), timeline.png (one lane per server and trainer rank, like the
paper's Figure 3). compare.png puts several runs side by side.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from areal.events import KINDS  # noqa: E402
from areal.report import data  # noqa: E402

# Drawn in this order, so a load shows on top of the pause around it.
COLORS = {
    "generate": "#43a047",
    "pause": "#bdbdbd",
    "load": "#fb8c00",
    "wait_batch": "#e57373",
    "pull": "#f06292",
    "proximal": "#64b5f6",
    "reference": "#9575cd",
    "update": "#1e40af",
    "values": "#4db6ac",
    "critic_update": "#00695c",
    "publish": "#8e24aa",
    "checkpoint": "#6d4c41",
    "update_weights": "#00897b",
    "borrow": "#212121",
}
NOT_DRAWN = {"decode", "cpu"}
"""Kinds the timeline leaves out: decode windows lie inside the generate spans they measure
(the planner's calibration reads them); cpu samples are no work (the summary's cores)."""
assert set(COLORS) | NOT_DRAWN == set(KINDS)
ZOOM_VERSIONS = 6
"""Versions shown in the timeline's close-up (the whole run is often too dense to read)."""


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def reward_figure(run: data.Run) -> Figure:
    steps, times, reward = data.series(run, "reward/mean")
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, x, xlabel in ((by_step, steps, "step"), (by_time, times, "wall time (s)")):
        ax.plot(x, reward, color="#90caf9", lw=1, label="batch mean")
        ax.plot(x, data.smooth(reward), color="#1565c0", lw=2, label="mean of last 10 steps")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    by_step.set_ylabel("reward")
    by_step.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{run.label}: reward")
    return fig


def staleness_figure(run: data.Run) -> Figure:
    fig, (top, dist) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True)
    steps, _, stale_max = data.series(run, "staleness/max")
    _, _, stale_mean = data.series(run, "staleness/mean")
    top.step(steps, stale_max, where="mid", color="#c62828", label="max")
    top.plot(steps, stale_mean, color="#1565c0", label="mean")
    bound = run.max_staleness
    if bound is not None:
        top.axhline(bound, color="k", ls=":", lw=1, label="bound (max_staleness)")
    # Room above the bound for the legend: the lines often sit on the bound.
    top.set_ylim(-0.3, max(bound or 0, *stale_max, 1) * 1.35 + 0.3)
    top.set_ylabel("staleness (versions)")
    top.legend(loc="upper left", fontsize=8, ncol=3)
    top.grid(alpha=0.3)
    b_steps, counts = data.staleness_counts(run)
    if len(b_steps):
        shares = counts / counts.sum(axis=1, keepdims=True)
        cmap = plt.get_cmap("viridis", counts.shape[1])
        bottom = np.zeros(len(b_steps))
        for s in range(counts.shape[1]):
            dist.bar(b_steps, shares[:, s], 1.0, bottom=bottom, color=cmap(s), label=f"{s}")
            bottom += shares[:, s]
        dist.legend(title="staleness", fontsize=7, title_fontsize=7, loc="center left",
                    bbox_to_anchor=(1.0, 0.5))  # fmt: skip
    dist.set_ylabel("share of the batch")
    dist.set_xlabel("step")
    fig.suptitle(f"{run.label}: staleness of the trained samples")
    return fig


def lengths_figure(run: data.Run) -> Figure:
    steps, per_step, every = data.output_lengths(run)
    fig, (over, tail) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    for (name, values), color in zip(
        per_step.items(), ("#1565c0", "#fb8c00", "#c62828", "#424242"), strict=True
    ):
        over.plot(steps, values, color=color, lw=1.5 if name != "max" else 1, label=name)
    over.set_xlabel("step")
    over.set_ylabel("output tokens")
    over.legend(fontsize=8, ncol=4)
    over.grid(alpha=0.3)
    if len(every):
        bins = np.arange(every.min(), every.max() + 2) - 0.5 if every.max() < 64 else 50
        tail.hist(every, bins=bins, color="#90caf9", edgecolor="#1565c0", log=True)
        for q, color in zip(data.LENGTH_PERCENTILES, ("#1565c0", "#fb8c00", "#c62828"),
                            strict=True):  # fmt: skip
            tail.axvline(np.percentile(every, q), color=color, ls="--", lw=1, label=f"p{q}")
        tail.legend(fontsize=8)
    tail.set_xlabel("output tokens (all samples)")
    tail.set_ylabel("samples (log)")
    fig.suptitle(f"{run.label}: output lengths")
    return fig


def throughput_figure(run: data.Run) -> Figure:
    fig, ax = plt.subplots(figsize=(11, 3.8))
    _, times, train = data.series(run, "throughput/train_tokens_per_s")
    ax.plot(times, train, color="#90caf9", lw=1, label="training (tokens consumed / s)")
    ax.plot(times, data.smooth(train), color="#1565c0", lw=2, label="training, last 10 steps")
    _, r_times, rollout = data.series(run, "rollout/tokens_per_s")
    if len(rollout):
        ax.plot(r_times, rollout, color="#43a047", lw=1, label="generation (tokens / s)")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("tokens / s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle(f"{run.label}: throughput")
    return fig


def _draw_lanes(
    ax: Axes,
    lanes: dict[str, list[data.Span]],
    marks: list[tuple[int, float]],
    window: tuple[float, float] | None = None,
    label_marks: bool = False,
) -> None:
    names = list(lanes)
    for row, name in enumerate(names):
        y = len(names) - 1 - row  # the first lane on top
        for kind, color in COLORS.items():
            bars = [(s.start, s.end - s.start) for s in lanes[name] if s.kind == kind]
            if bars:
                # In a close-up, a thin white edge separates back-to-back spans (the
                # minibatch updates); over a whole run it would hide the short ones.
                edge = 0.4 if window is not None else 0
                # A borrow span overlaps the work it speeds up: a strip along the lane's foot.
                band = (y - 0.4, 0.16) if kind == "borrow" else (y - 0.4, 0.8)
                ax.broken_barh(bars, band, facecolors=color, edgecolors="white", linewidth=edge)
    for version, t in marks:
        if window is None or window[0] <= t <= window[1]:
            ax.axvline(t, color="k", lw=0.6, ls="--", alpha=0.5 if label_marks else 0.2)
            if label_marks:
                ax.text(t, len(names) - 0.45, f"v{version}", fontsize=7, ha="center", va="bottom")
    ax.set_yticks(range(len(names)), names[::-1])
    ax.set_ylim(-0.6, len(names) - 0.3 + (0.4 if label_marks else 0))
    if window is not None:
        ax.set_xlim(*window)
    ax.set_xlabel("wall time (s)")


def zoom_window(marks: list[tuple[int, float]]) -> tuple[float, float] | None:
    """A few versions from the middle of the run; None when the run is that short."""
    if len(marks) < ZOOM_VERSIONS + 2:
        return None
    first = len(marks) // 2 - ZOOM_VERSIONS // 2
    a, b = marks[first][1], marks[first + ZOOM_VERSIONS][1]
    pad = 0.15 * (b - a) / ZOOM_VERSIONS
    return a - pad, b + pad


def timeline_figure(run: data.Run) -> Figure:
    lanes = data.lanes(run)
    marks = data.version_marks(run)
    window = zoom_window(marks)
    height = 0.45 * len(lanes) + 1.6
    n_axes = 2 if window else 1
    fig, axes = plt.subplots(n_axes, 1, figsize=(12, height * n_axes), squeeze=False)
    _draw_lanes(axes[0, 0], lanes, marks)
    axes[0, 0].set_title("the whole run (dashed: a new version published; white: idle)", fontsize=9)
    if window:
        _draw_lanes(axes[1, 0], lanes, marks, window, label_marks=True)
        axes[1, 0].set_title(f"close-up: {ZOOM_VERSIONS} versions mid-run", fontsize=9)
    kinds = [k for k in COLORS if any(s.kind == k for spans in lanes.values() for s in spans)]
    share = data.idle_while_busy_share(lanes)
    idle = (
        ""
        if np.isnan(share)
        else f" (a lane idle, its core not lent, while another computes: {share:.0%})"
    )
    fig.suptitle(f"{run.label}: timeline{idle}")
    fig.tight_layout()
    fig.legend(
        handles=[Patch(color=COLORS[k], label=KINDS[k]) for k in kinds],
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize=8,
    )
    return fig


def write_run_figures(run: data.Run, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        _save(reward_figure(run), out_dir / "reward.png"),
        _save(staleness_figure(run), out_dir / "staleness.png"),
        _save(lengths_figure(run), out_dir / "lengths.png"),
        _save(throughput_figure(run), out_dir / "throughput.png"),
    ]
    if run.events:
        written.append(_save(timeline_figure(run), out_dir / "timeline.png"))
    return written


def compare_figure(runs: list[data.Run]) -> Figure:
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    cmap = plt.get_cmap("tab10")
    for i, run in enumerate(runs):
        color = cmap(i % 10)
        steps, times, reward = data.series(run, "reward/mean")
        axes[0, 0].plot(steps, data.smooth(reward), color=color, lw=2, label=run.label)
        axes[0, 1].plot(times, data.smooth(reward), color=color, lw=2)
        _, t_times, tput = data.series(run, "throughput/train_tokens_per_s")
        axes[1, 0].plot(t_times, data.smooth(tput), color=color, lw=2)
        s_steps, _, stale = data.series(run, "staleness/mean")
        axes[1, 1].plot(s_steps, stale, color=color, lw=1.5)
    titles = (
        ("reward (mean of last 10 steps)", "step"),
        ("reward (mean of last 10 steps)", "wall time (s)"),
        ("training throughput, tokens/s (last 10 steps)", "wall time (s)"),
        ("mean staleness of the batch", "step"),
    )
    for ax, (title, xlabel) in zip(axes.flat, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(" vs ".join(r.label for r in runs))
    fig.tight_layout()
    return fig


def write_compare_figure(runs: list[data.Run], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    return _save(compare_figure(runs), out_dir / "compare.png")
