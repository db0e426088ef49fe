"""One tiny-config training run as a user starts it; the benchmarks compare such runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_tiny(fileroot: str, name: str, steps: int, overrides: list[str]) -> list[dict]:
    """`python -m areal.train --config configs/tiny.yaml ...`; returns its metrics lines."""
    cmd = [
        sys.executable,
        "-m",
        "areal.train",
        "--config",
        str(ROOT / "configs/tiny.yaml"),
        f"fileroot={fileroot}",
        f"trial_name={name}",
        f"total_train_steps={steps}",
        *overrides,
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    lines = (Path(fileroot) / "tiny" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def effective_throughput(metrics: list[dict]) -> float:
    """The paper's measure: tokens trained per second of wall time, the first fifth of the
    steps (warm-up) left out. Each record needs "train/n_tokens" and "time" (its end)."""
    warm = len(metrics) // 5
    tokens = sum(x["train/n_tokens"] for x in metrics[warm + 1 :])
    return tokens / (metrics[-1]["time"] - metrics[warm]["time"])
