"""A real tiny run seen through its observability: TensorBoard files equal metrics.jsonl, an
offline W&B run, every role's event spans, role logs with context, and areal.report on it.
A broken W&B setting warns and the run still completes."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from areal.events import read_events
from areal.report import data
from areal.report.__main__ import main as report_main
from tests.system.test_run import ROOT, read_metrics, train_cmd

STEPS = 10


def wandb_env(tmp_path) -> dict[str, str]:
    """No key, no reachable server, nothing written to $HOME: a test never uses the network."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env.update(
        WANDB_BASE_URL="http://127.0.0.1:9",
        WANDB_ERROR_REPORTING="false",
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
    )
    return env


def run(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_cmd(tmp_path, *overrides),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=wandb_env(tmp_path),
    )


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory, shared_tiny_models):
    root = tmp_path_factory.mktemp("observed")
    proc = run(root, f"total_train_steps={STEPS}", "trial_name=obs", "stats.wandb.mode=offline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "tiny/obs", proc


def test_tensorboard_scalars_equal_metrics(observed_run):
    exp, _ = observed_run
    metrics = read_metrics(exp)
    acc = EventAccumulator(str(exp / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    keys = {k for m in metrics for k, v in m.items() if k != "step" and isinstance(v, int | float)}
    assert {"reward/mean", "staleness/max", "throughput/train_tokens_per_s"} <= keys
    assert set(acc.Tags()["scalars"]) == keys
    for key in keys:
        expected = [(m["step"], np.float32(m[key])) for m in metrics if key in m]
        assert [(e.step, e.value) for e in acc.Scalars(key)] == expected, key


def test_offline_wandb_run_is_written(observed_run):
    exp, proc = observed_run
    (run_dir,) = (exp / "wandb").glob("offline-run-*")
    (history,) = run_dir.glob("run-*.wandb")
    body = history.read_bytes()
    assert b"reward/mean" in body and b"throughput/train_tokens_per_s" in body
    assert "warning" not in proc.stderr


def test_every_role_records_its_spans(observed_run):
    exp, _ = observed_run
    spans = read_events(exp)
    kinds = {(e["role"], e["kind"]) for e in spans}
    for role, kind in [
        ("server0", "generate"), ("server0", "load"),
        ("trainer0", "wait_batch"), ("trainer0", "proximal"), ("trainer0", "update"),
        ("trainer0", "publish"), ("trainer0", "checkpoint"), ("controller0", "update_weights"),
    ]:  # fmt: skip
        assert (role, kind) in kinds, (role, kind)
    # Every role samples its CPU seconds; the report keeps them off the timeline's spans.
    run = data.load_run(exp)
    assert {e["role"] for e in run.cpu} >= {"controller0", "server0", "trainer0"}
    assert all(e["kind"] != "cpu" for e in run.events)
    published = [e["version"] for e in spans if e["kind"] == "publish"]
    assert published == list(range(1, STEPS + 1))
    updates = [e for e in spans if e["kind"] == "update"]
    assert len(updates) == STEPS * 4  # ppo.n_minibatches in configs/tiny.yaml
    loaded = [e["version"] for e in spans if e["kind"] == "load"]
    assert loaded == sorted(loaded) and loaded[0] == 1
    assert all(e["end"] >= e["start"] for e in spans)
    # An update that finds requests in flight interrupts them, and loads inside the pause
    # around it; one that finds the server idle (the tiny run's usual case: its rollouts
    # outpace training up to the staleness bound) loads without one. (test_events: the
    # server's pause spans themselves.)
    loads = [e for e in spans if e["kind"] == "load"]
    for pause in (e for e in spans if e["kind"] == "pause"):
        assert any(pause["start"] <= x["start"] and x["end"] <= pause["end"] for x in loads)


def test_role_logs_carry_time_and_version(observed_run):
    exp, proc = observed_run
    trainer_log = (exp / "logs/trainer0.log").read_text()
    assert f"trainer0 [step {STEPS} version {STEPS}] areal.trainer INFO: trained in" in trainer_log
    assert f"controller0 [version {STEPS}]" in (exp / "logs/controller0.log").read_text()
    assert "| ETA 0s" in proc.stdout  # the last step's console line


def test_report_on_the_run(observed_run, capsys):
    exp, _ = observed_run
    assert report_main([str(exp)]) == 0
    written = {p.name for p in (exp / "report").iterdir()}
    assert written == {"reward.png", "staleness.png", "lengths.png", "throughput.png",
                       "timeline.png"}  # fmt: skip
    out = capsys.readouterr().out
    assert f"tiny/obs: {STEPS} steps" in out and "trainer0" in out and "server0" in out

    run = data.load_run(exp)
    metrics = read_metrics(exp)
    batches = [json.loads(x) for x in (exp / "batches.jsonl").read_text().splitlines()]
    steps, times, reward = data.series(run, "reward/mean")
    assert steps.tolist() == list(range(1, STEPS + 1))
    assert times.tolist() == [m["time"] for m in metrics]
    assert reward.tolist() == [m["reward/mean"] for m in metrics]
    # The per-sample files agree with the per-step metrics they stand behind.
    b_steps, counts = data.staleness_counts(run)
    assert b_steps.tolist() == steps.tolist()
    assert (counts.sum(axis=1) == 16 * 8).all()  # trainer.batch_size x rollout.group_size
    top = [max(np.nonzero(row)[0]) for row in counts]
    assert top == [m["staleness/max"] for m in metrics]
    _, per_step, every = data.output_lengths(run)
    assert len(every) == STEPS * 16 * 8
    assert every.sum() == sum(m["train/n_tokens"] for m in metrics)
    assert per_step["max"].tolist() == [max(b["output_len"]) for b in batches]
    assert [v for v, _ in data.version_marks(run)] == list(range(1, STEPS + 1))
    assert list(data.lanes(run)) == ["server0", "trainer0", "controller0"]
    assert data.summary(run)["steps"] == STEPS


def test_broken_wandb_setting_warns_and_the_run_completes(tmp_path):
    # Online without an API key (and no reachable server): W&B cannot start.
    proc = run(tmp_path, "total_train_steps=3", "trial_name=nokey", "stats.wandb.mode=online")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("W&B logging could not start") == 1, proc.stderr[-3000:]
    exp = tmp_path / "tiny/nokey"
    assert len(read_metrics(exp)) == 3
    assert list((exp / "tensorboard").glob("events.out.tfevents.*"))  # the others go on
