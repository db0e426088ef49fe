"""Metric loggers: TensorBoard round trip, a failing logger warns once and the rest go on;
the console's ETA."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from areal.launcher.progress import Progress, eta_seconds, format_duration
from areal.loggers import MetricSink, TensorBoardLogger, scalars

RECORDS = [
    {"step": 1, "version": 1, "time": 1.5, "reward/mean": -3.25, "trainer/dp": 1},
    {"step": 2, "version": 2, "time": 2.75, "reward/mean": 0.1, "flag": True, "note": "x"},
]


def read_tensorboard(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_scalars_are_the_numbers_but_the_step():
    assert scalars(RECORDS[1]) == {"version": 2.0, "time": 2.75, "reward/mean": 0.1}


def test_tensorboard_round_trip(tmp_path):
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "stale.txt").write_text("from an earlier launch")
    logger = TensorBoardLogger(tmp_path / "tb")
    for r in RECORDS:
        logger.log(r["step"], scalars(r))
    logger.close()
    assert not (tmp_path / "tb" / "stale.txt").exists()  # rebuilt, not appended
    got = read_tensorboard(tmp_path / "tb")
    assert got["reward/mean"] == [(1, np.float32(-3.25)), (2, np.float32(0.1))]
    assert got["trainer/dp"] == [(1, 1.0)]
    assert "step" not in got and "note" not in got


class _Broken:
    name = "Broken"

    def __init__(self):
        self.calls = 0

    def log(self, step, values):
        self.calls += 1
        raise ConnectionError("no network")

    def close(self):
        pass


class _Keeping:
    name = "Keeping"

    def __init__(self):
        self.steps = []
        self.closed = False

    def log(self, step, values):
        self.steps.append(step)

    def close(self):
        self.closed = True


def test_failing_loggers_warn_once_and_the_others_go_on(capsys):
    broken, keeping = _Broken(), _Keeping()

    def cannot_start():
        raise RuntimeError("bad key")

    sink = MetricSink(
        [("W&B", cannot_start), ("Broken", lambda: broken), ("Keeping", lambda: keeping)]
    )
    for step in range(1, 6):
        sink.log({"step": step, "reward/mean": 0.0})
    sink.close()
    err = capsys.readouterr().err
    assert err.count("W&B logging could not start (RuntimeError: bad key)") == 1
    assert err.count("Broken logging failed (ConnectionError: no network)") == 1
    assert "the run goes on without it" in err
    assert broken.calls == 1  # dropped after its first failure
    assert keeping.steps == [1, 2, 3, 4, 5] and keeping.closed


def test_wandb_configured_but_missing_names_the_fix(monkeypatch, tmp_path):
    import builtins

    from areal.config import load_config
    from areal.loggers import WandbLogger

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    cfg = load_config(None, [f"fileroot={tmp_path}", "stats.wandb.mode=offline"])
    with pytest.raises(RuntimeError, match="pip install wandb.*stats.wandb.mode=disabled"):
        WandbLogger(cfg)


def test_eta_uses_the_runs_clock():
    # 10 s per step so far, 90 steps to go.
    assert eta_seconds([(s, 10.0 * s) for s in range(1, 11)], 100) == pytest.approx(900.0)
    # One line: the first step's own time.
    assert eta_seconds([(1, 4.0)], 11) == pytest.approx(40.0)
    # A resumed run: its first line read is step 31, at 62 s of run time.
    assert eta_seconds([(31, 62.0)], 41) == pytest.approx(20.0)
    # Recent speed: only the last 20 steps count (a slow warm-up is forgotten).
    times = [(1, 100.0)] + [(s, 100.0 + (s - 1)) for s in range(2, 40)]
    assert eta_seconds(times, 50) == pytest.approx(11.0)
    assert eta_seconds([(5, 10.0)], 5) == 0.0


def test_format_duration():
    assert [format_duration(s) for s in (4.4, 65, 3725)] == ["4s", "1m05s", "1h02m"]


def test_progress_prints_each_step_with_eta_and_feeds_the_sink(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    line = {"version": 1, "reward/mean": 1.0, "staleness/max": 2}
    rows = [
        {**line, "step": s, "time": 2.0 * s, "throughput/train_tokens_per_s": 10.0} for s in (1, 2)
    ]
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1])[:10])  # 2nd: partial
    keeping = _Keeping()
    progress = Progress(path, 4, MetricSink([("Keeping", lambda: keeping)]))
    progress.poll()
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n")
    progress.poll()
    progress.close()
    out = capsys.readouterr().out
    assert "step    1 |" in out and "| ETA 6s" in out  # 3 steps left at 2 s each
    assert "step    2 |" in out and "| ETA 4s" in out
    assert keeping.steps == [1, 2] and keeping.closed


def test_wandb_configured_but_not_installed_stops_before_the_run(monkeypatch, tmp_path, capsys):
    import importlib.util

    from areal import train

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real_find_spec(n, *a)
    )
    assert train.main([f"fileroot={tmp_path}", "stats.wandb.mode=online"]) == 2
    err = capsys.readouterr().err
    assert "stats.wandb.mode=online needs the wandb package: pip install 'areal[wandb]'" in err
    assert not (tmp_path / "tiny").exists()  # nothing was started or prepared
