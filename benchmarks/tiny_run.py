"""Training runs as a user starts them; the benchmarks compare such runs."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/tiny.yaml"


def train_tiny(
    fileroot: str,
    name: str,
    steps: int,
    overrides: list[str],
    config: Path = TINY,
    timeout_s: float | None = None,
) -> list[dict]:
    """`python -m areal.train --config CONFIG ...`; returns its metrics lines. The tiny
    model is made by the first run that needs it, once per machine (areal/models/cache.py).
    timeout_s: a deadline for the whole run (subprocess.TimeoutExpired past it)."""
    cmd = [
        sys.executable,
        "-m",
        "areal.train",
        "--config",
        str(config),
        f"fileroot={fileroot}",
        f"trial_name={name}",
        f"total_train_steps={steps}",
        *overrides,
    ]
    # Its own session, so that a run past its deadline is stopped with every role it started.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=timeout_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):  # (its session sees no Ctrl-C)
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its roles
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        raise
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    experiment = yaml.safe_load(Path(config).read_text())["experiment_name"]
    lines = (Path(fileroot) / experiment / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def effective_throughput(metrics: list[dict]) -> float:
    """The paper's measure: tokens trained per second of wall time, the first fifth of the
    steps (warm-up) left out. Each record needs "train/n_tokens" and "time" (its end)."""
    warm = len(metrics) // 5
    tokens = sum(x["train/n_tokens"] for x in metrics[warm + 1 :])
    return tokens / (metrics[-1]["time"] - metrics[warm]["time"])


def medians(results: dict[str, list[dict]]) -> dict[str, dict]:
    """{variant: [one dict of figures per repeat]} -> {variant: {figure: median}}."""
    return {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in results.items()}
