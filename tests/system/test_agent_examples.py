"""The example agents as whole runs: `python -m areal.train` with their configs, on CPU."""

from __future__ import annotations

import pytest

from tests.system.test_run import ROOT, processes_mentioning, read_metrics, run_train

pytest.importorskip("openai")


def test_multi_turn_arithmetic_learns(tmp_path):
    """Answer, hear "wrong, try again", retry: the reward rises and fewer retries are needed.
    (45 steps: at 30 the rise of the best 10-step mean over the first 5 steps ranged from
    1.0 to 2.9 across seeds and machine load; at 45, 2.1 to 2.9.)"""
    steps = 45
    proc = run_train(
        tmp_path,
        f"total_train_steps={steps}",
        "trial_name=mt",
        "trainer.batch_size=8",
        config=ROOT / "configs/multi_turn.yaml",
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(tmp_path / "multi_turn/mt")
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["staleness/max"] <= 4 for m in metrics)
    assert sum(m["rollout/episodes_rejected"] + m["rollout/episodes_timeout"] for m in metrics) == 0
    assert metrics[0]["episode/calls_mean"] > 1.5  # the untrained model needs retries
    rewards = [m["reward/mean"] for m in metrics]
    first = sum(rewards[:5]) / 5
    best = max(sum(rewards[i : i + 10]) / 10 for i in range(steps - 9))
    assert best > first + 1.0, rewards
    assert processes_mentioning(str(tmp_path)) == []


def test_calculator_agent_trains_on_concat_samples(tmp_path):
    proc = run_train(
        tmp_path,
        "total_train_steps=4",
        "trial_name=calc",
        "trainer.batch_size=4",
        config=ROOT / "configs/calculator.yaml",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(tmp_path / "calculator/calc")
    assert len(metrics) == 4
    # One sequence per episode (the tiny template appends), none rejected.
    assert sum(m["rollout/concat_fallbacks"] for m in metrics) == 0
    assert sum(m["rollout/episodes_rejected"] for m in metrics) == 0
    assert all(m["train/n_tokens"] > 0 for m in metrics)


def test_a_wrong_workflow_is_a_clear_error_before_anything_starts(tmp_path):
    proc = run_train(tmp_path, "rollout.workflow=examples.nope:run", timeout=60)
    assert proc.returncode == 2
    assert "rollout.workflow='examples.nope:run': cannot import 'examples.nope'" in proc.stderr
