"""areal.report on a hand-made run directory: the series each figure draws, the summary,
and clear errors for directories that are not runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.colors import to_rgba

from areal.report import data
from areal.report.__main__ import main

T0 = 1_700_000_000.0


def write_run(root, n_steps=10, with_events=True):
    """A run of n_steps: reward 0.5 * step, staleness s = step % 3, lengths 1..step."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text("experiment_name: exp\ntrial_name: t1\nmax_staleness: 2\n")
    metrics, batches, server, trainer = [], [], [], []
    for step in range(1, n_steps + 1):
        stale = [step % 3] * 2 + [0]
        metrics.append(
            {"step": step, "version": step, "time": 2.0 * step, "reward/mean": 0.5 * step,
             "staleness/max": max(stale), "staleness/mean": float(np.mean(stale)),
             "throughput/train_tokens_per_s": 100.0 + step, "rollout/tokens_per_s": 50.0}
        )  # fmt: skip
        batches.append(
            {"step": step, "output_len": list(range(1, step + 1)), "staleness": stale,
             "reward": [5.0] * step}
        )  # fmt: skip
        t = T0 + 2.0 * (step - 1)
        trainer += [
            {"role": "trainer0", "kind": "wait_batch", "start": t, "end": t + 0.5},
            {"role": "trainer0", "kind": "update", "start": t + 0.5, "end": t + 1.9},
            {"role": "trainer0", "kind": "publish", "start": t + 1.9, "end": t + 2.0,
             "version": step},
        ]  # fmt: skip
        lane = {"role": "server0"}
        server += [
            {**lane, "kind": "generate", "start": t, "end": t + 1.5, "version": step - 1},
            {**lane, "kind": "pause", "start": t + 1.5, "end": t + 2.0, "version": step},
        ]
    (root / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (root / "batches.jsonl").write_text("".join(json.dumps(b) + "\n" for b in batches))
    # CPU samples every 2 s: start-up (before the first publish) burns 2 cores; then the
    # trainer uses 0.5 and a rollout worker (no spans of work) 0.1.
    cpu = [
        {"role": role, "kind": "cpu", "start": t, "end": t + 2.0, "cpu_s": 4.0 if t < T0 else c}
        for t in np.arange(T0 - 2.0, T0 + 2.0 * n_steps, 2.0)
        for role, c in (("trainer0", 1.0), ("rollout0", 0.2))
    ]
    trainer += [e for e in cpu if e["role"] == "trainer0"]
    if with_events:
        (root / "events").mkdir()
        rollout = [e for e in cpu if e["role"] == "rollout0"]
        for name, spans in (("trainer0", trainer), ("server0", server), ("rollout0", rollout)):
            text = "".join(json.dumps(s) + "\n" for s in spans)
            (root / "events" / f"{name}.jsonl").write_text(text)
    return metrics, batches


def test_series_equal_the_files(tmp_path):
    metrics, batches = write_run(tmp_path / "run")
    run = data.load_run(tmp_path / "run")
    assert run.label == "exp/t1" and run.max_staleness == 2
    steps, times, reward = data.series(run, "reward/mean")
    assert steps.tolist() == [m["step"] for m in metrics]
    assert times.tolist() == [m["time"] for m in metrics]
    assert reward.tolist() == [m["reward/mean"] for m in metrics]
    assert data.series(run, "no/such/key")[0].tolist() == []

    b_steps, counts = data.staleness_counts(run)
    assert b_steps.tolist() == list(range(1, 11))
    assert counts.shape == (10, 3)  # 0..max_staleness
    for b, row in zip(batches, counts, strict=True):
        assert row.tolist() == [b["staleness"].count(s) for s in range(3)]

    l_steps, per_step, every = data.output_lengths(run)
    assert l_steps.tolist() == list(range(1, 11))
    assert per_step["max"].tolist() == list(range(1, 11))
    assert per_step["p50"].tolist() == [np.percentile(range(1, s + 1), 50) for s in range(1, 11)]
    assert sorted(every.tolist()) == sorted(n for b in batches for n in b["output_len"])


def test_smooth_is_a_trailing_mean():
    assert data.smooth(np.array([1.0, 3.0, 5.0, 7.0]), window=2).tolist() == [1, 2, 4, 6]


def test_timeline_lanes_marks_and_waiting(tmp_path):
    write_run(tmp_path / "run", n_steps=4)
    run = data.load_run(tmp_path / "run")
    lanes = data.lanes(run)
    assert list(lanes) == ["server0", "trainer0"]  # generation above training
    assert lanes["server0"][0] == data.Span("generate", 0.0, 1.5, 0)
    assert [s.kind for s in lanes["trainer0"][:3]] == ["wait_batch", "update", "publish"]
    assert data.version_marks(run) == [(v, pytest.approx(2.0 * v)) for v in range(1, 5)]
    waits = data.summary(run)["waiting"]
    assert waits["trainer0"] == pytest.approx(0.25)  # 0.5 s of every 2 s
    assert waits["server0"] == pytest.approx(0.25)  # not generating 0.5 s of every 2 s
    # Each 2 s: the trainer waits 0.5 s while the server generates, the server pauses 0.5 s
    # while the trainer updates and publishes.
    assert data.summary(run)["idle_while_busy"] == pytest.approx(0.5)
    assert sorted(["controller0", "trainer1", "server10", "server2"], key=data.lane_order) == [
        "server2", "server10", "trainer1", "controller0"
    ]  # fmt: skip


def test_summary_and_its_text(tmp_path):
    write_run(tmp_path / "run")
    s = data.summary(data.load_run(tmp_path / "run"))
    assert (s["steps"], s["final_reward"], s["best_reward"], s["best_step"]) == (10, 5, 5, 10)
    assert s["median_train_tokens_per_s"] == pytest.approx(105.5)
    text = data.format_summary(s)
    assert "exp/t1: 10 steps in 20.0s" in text
    assert s["smoothed_final_reward"] == pytest.approx(2.75)  # 0.5 * (1 + ... + 10) / 10
    assert "reward: +2.75 (mean of the last 10 steps; the last step's batch alone +5.00), " in text
    assert "best +5.00 (step 10)" in text
    assert "server0 25% (not generating), trainer0 25%" in text
    assert "a lane idle, its core not lent, while another computes: 50% of the run" in text
    assert s["cores"] == pytest.approx({"trainer0": 0.5, "rollout0": 0.1})
    assert "cores used (CPU-s a second, after start-up): trainer0 0.50, rollout0 0.10" in text


def span(kind, start, end):
    return data.Span(kind, start, end, None)


def test_idle_while_busy_counts_only_one_lane_waiting_for_another():
    both_work = {"server0": [span("generate", 0, 10)], "trainer0": [span("update", 0, 10)]}
    assert data.idle_while_busy_share(both_work) == 0.0
    # Idle together (3-5) is not a lost core; the server's load is work; nested spans merge.
    lanes = {
        "server0": [span("generate", 0, 3), span("pause", 3, 6), span("load", 5, 6),
                    span("generate", 6, 10)],
        "trainer0": [span("update", 0, 2), span("proximal", 1, 2), span("wait_batch", 2, 5),
                     span("update", 5, 10)],
    }  # fmt: skip
    assert data.idle_while_busy_share(lanes) == pytest.approx(0.1)  # 2-3 only
    # Counted once every lane has started and until the first one stops.
    late = {"server0": [span("generate", 0, 10)], "trainer0": [span("update", 4, 8)]}
    assert data.idle_while_busy_share(late) == 0.0
    assert np.isnan(data.idle_while_busy_share({"server0": [span("generate", 0, 1)]}))


def test_a_lane_whose_core_is_lent_is_not_idle():
    lanes = {
        "server0": [span("generate", 0, 4), span("generate", 6, 10)],
        "trainer0": [span("update", 0, 10), data.Span("borrow", 4.5, 6, None, 1)],
    }
    assert data.idle_while_busy_share(lanes) == pytest.approx(0.05)  # 4-4.5 only
    # Three lanes: one borrowed share covers one of two idle lanes, not both.
    lanes["trainer1"] = [span("update", 0, 4), span("update", 6, 10)]
    assert data.idle_while_busy_share(lanes) == pytest.approx(0.2)  # 4-6 (one unlent)


def test_figures_draw_the_extracted_series(tmp_path):
    from areal.report import plots

    write_run(tmp_path / "run")
    run = data.load_run(tmp_path / "run")
    fig = plots.reward_figure(run)
    steps, times, reward = data.series(run, "reward/mean")
    by_step, by_time = fig.axes
    assert by_step.lines[0].get_xdata().tolist() == steps.tolist()
    assert by_step.lines[0].get_ydata().tolist() == reward.tolist()
    assert by_time.lines[0].get_xdata().tolist() == times.tolist()
    fig = plots.timeline_figure(run)
    whole = fig.axes[0]
    assert [t.get_text() for t in whole.get_yticklabels()] == ["trainer0", "server0"]
    # server0's generate bars (the top lane) are its 10 generate spans.
    green = to_rgba(plots.COLORS["generate"])
    (bars,) = [c for c in whole.collections if tuple(c.get_facecolor()[0]) == green]
    assert len(bars.get_paths()) == 10
    assert bars.get_paths()[0].get_extents().x0 == pytest.approx(0.0)
    assert bars.get_paths()[0].get_extents().x1 == pytest.approx(1.5)


def test_main_writes_every_figure_and_a_comparison(tmp_path, capsys):
    write_run(tmp_path / "a")
    write_run(tmp_path / "b", with_events=False)
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    names = {"reward.png", "staleness.png", "lengths.png", "throughput.png"}
    assert {p.name for p in (tmp_path / "a/report").iterdir()} == names | {"timeline.png"}
    assert {p.name for p in (tmp_path / "b/report").iterdir()} == names
    assert (tmp_path / "report-compare/compare.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "no events/: no timeline" in out
    # Same experiment and trial names: the labels fall back to the paths.
    assert f"{tmp_path / 'a'}: 10 steps" in out


def test_not_a_run_fails_clearly(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} is not a run directory: it has no metrics.jsonl" in err
    assert main([str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main([str(tmp_path)]) == 2
    assert "no finished training step yet" in capsys.readouterr().err
