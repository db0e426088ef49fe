"""A short run of configs/tiny_longtail.yaml: the paper's regime in miniature."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.system.test_run import ROOT, read_metrics, run_train

ETA = 4


@pytest.mark.timeout(420)
def test_longtail_run_is_bounded_interrupted_and_long_tailed(tmp_path):
    """Staleness stays within eta, updates interrupt generations (samples of several
    versions), and the outputs have the task's long tail (p99 many times the median)."""
    proc = run_train(
        tmp_path,
        "total_train_steps=16",
        f"max_staleness={ETA}",
        "model.tiny_warmup_steps=300",  # enough for the format; the config's 1500 learn more
        "trial_name=lt",
        timeout=400,
        config=ROOT / "configs/tiny_longtail.yaml",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    exp = tmp_path / "tiny_longtail/lt"
    metrics = read_metrics(exp)
    assert [m["step"] for m in metrics] == list(range(1, 17))
    assert all(m["staleness/max"] <= ETA for m in metrics)
    assert max(m["staleness/max"] for m in metrics) >= 1  # asynchronous in fact
    assert sum(m["rollout/multi_version_samples"] for m in metrics) > 0
    # The server's log-probs of fresh tokens are the trainer's. Long answers in float32: up
    # to a few 1e-5 (docs/get-started/reading-a-run.md; 1.3e-6 to 9.5e-6 a step over a
    # 40-step run), more than short ones' 1e-6; a policy that differs (weights not loaded) is
    # off by 1e-2 or more.
    gaps = sorted(m["train/fresh_logprob_diff_max"] for m in metrics if m["train/fresh_tokens"])
    assert gaps and gaps[len(gaps) // 2] < 1e-4 and gaps[-1] < 1e-3, gaps
    batches = [json.loads(line) for line in (exp / "batches.jsonl").read_text().splitlines()]
    lengths = sorted(n for b in batches for n in b["output_len"])
    median, p99 = statistics.median(lengths), lengths[int(0.99 * (len(lengths) - 1))]
    assert 10 <= median <= 100, lengths
    # A 16-step asynchronous run trains first on the answers that finish first, so its tail
    # is thinner than the task's (p99 >= 8x the median: tests/unit/test_longtail.py); p99
    # was 4.8x to 15x the median in runs of this test, the longest 6.3x or more (a task
    # without a tail, such as arith, has both within 2x of its median).
    assert p99 >= 4 * median and lengths[-1] >= 5 * median, (median, p99, lengths[-1])
    assert lengths[-1] <= 512
