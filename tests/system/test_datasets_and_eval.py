"""Real datasets end to end: a short math run through `areal.train`, and `areal.eval`.

The tiny model cannot solve these problems (every reward is -5); what is checked is that the
whole path runs: file -> prompts -> generation -> math grading in the pool -> PPO steps ->
metrics with the reward service's counters, and eval's numbers are sane.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.system.test_run import processes_mentioning, read_metrics, run_train

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests/data"
SMALL = (
    "model.tiny_warmup_steps=0",  # the warm-up teaches sums, useless here; skip its minutes
    "trainer.batch_size=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=16",
)


def test_a_short_math_run(tmp_path):
    proc = run_train(
        tmp_path,
        "dataset.type=math",
        f"dataset.path={DATA / 'math_sample.jsonl'}",
        "total_train_steps=2",
        "trial_name=math",
        *SMALL,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "12 math problems" in proc.stdout
    metrics = read_metrics(tmp_path / "tiny/math")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["reward/mean"] == -5.0  # graded, and wrong: the tiny model boxes nothing
        assert m["reward/timeouts"] == 0 and m["reward/errors"] == 0
    assert processes_mentioning(str(tmp_path)) == []


def test_a_bad_dataset_is_reported_before_anything_starts(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no problem field"}\n')
    proc = run_train(tmp_path, "dataset.type=math", f"dataset.path={bad}", timeout=60)
    assert proc.returncode == 2
    assert f"{bad}:1" in proc.stderr and "no usable math row" in proc.stderr


def test_eval_reports_sane_pass_at_k(tmp_path):
    from areal.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", warmup_steps=0)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "areal.eval", "--model", str(model)]
    cmd += ["--data", str(DATA / "math_sample.json"), "--n-samples", "4", "--k", "1,2,4"]
    cmd += ["--max-new-tokens", "8", "--temperature", "1.0", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["task"] == "math"  # inferred from the file
    assert result["n_problems"] == 4 and result["n_samples"] == 4
    s = result["scores"]
    assert 0.0 <= s["pass@1"] <= s["pass@2"] <= s["pass@4"] <= 1.0
    assert result["reward_counts"]["graded"] == 16
    assert "pass@4" in proc.stdout and "wrote" in proc.stdout
    assert processes_mentioning(str(tmp_path)) == []


def test_a_short_code_run(tmp_path):
    """dataset.type=code end to end: the code grader in the reward service's pool (the tiny
    model writes no program, so every answer is wrong, and nothing errs or times out)."""
    proc = run_train(
        tmp_path,
        "dataset.type=code",
        f"dataset.path={DATA / 'code_sample.jsonl'}",
        "total_train_steps=2",
        "trial_name=code",
        *SMALL,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "5 code problems" in proc.stdout
    metrics = read_metrics(tmp_path / "tiny/code")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["reward/mean"] == -5.0
        assert m["reward/timeouts"] == 0 and m["reward/errors"] == 0
    assert processes_mentioning(str(tmp_path)) == []


def test_eval_runs_the_configured_agent_workflow(tmp_path):
    """--config's rollout.workflow (the multi-turn agent), through the controller's episode
    API: each of the n samples is one agent episode, graded by the agent itself."""
    pytest.importorskip("openai")
    from areal.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", warmup_steps=0)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "areal.eval", "--model", str(model)]
    cmd += ["--config", str(ROOT / "configs/multi_turn.yaml"), "--max-problems", "3"]
    cmd += ["--n-samples", "2", "--k", "1,2", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["workflow"] == "examples.multi_turn_arith:run" and result["task"] == "arith"
    assert result["sampling"]["max_new_tokens"] == 8  # the config's, not eval's default
    assert result["n_problems"] == 3 and len(result["per_problem_correct"]) == 3
    stats = result["workflow_stats"]
    assert stats["episode/count"] == 6  # 3 problems x 2 samples, one episode each
    assert 1 <= stats["episode/calls_mean"] <= 3  # up to rollout.max_turns calls
    assert result["reward_counts"]["graded"] == 0  # the agent grades itself
    assert result["episode_counts"] == {"rejected": 0, "timeout": 0, "declined": 0}
    s = result["scores"]
    assert 0.0 <= s["pass@1"] <= s["pass@2"] <= 1.0
    assert processes_mentioning(str(tmp_path)) == []
