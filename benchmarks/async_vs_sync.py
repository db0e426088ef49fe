"""Asynchronous (max_staleness > 0) against synchronous (= 0) RL, one config, run after run.

    python benchmarks/async_vs_sync.py [--config configs/tiny.yaml] [--max-staleness 4]
        [--steps 100] [--repeats 1] [--target-reward 0] [--png FILE] [key=value ...]

Effective training throughput is the paper's: generated tokens consumed by PPO updates per
second of wall time, after warm-up (the first fifth of the steps is left out). Time to
target is the wall time at which the mean reward of the last 10 steps first reaches
--target-reward (inf when never). Prints both variants side by side and the ratios last;
with --repeats > 1, medians. --png draws reward against wall time, every run. max_staleness
is the config's name for the paper's eta.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

from tiny_run import TINY, effective_throughput, medians, train_tiny

WINDOW = 10  # steps in the reward's moving mean


def moving_reward(metrics: list[dict]) -> list[float]:
    rewards = [x["reward/mean"] for x in metrics]
    return [statistics.mean(rewards[max(0, i + 1 - WINDOW) : i + 1]) for i in range(len(rewards))]


def time_to_target(metrics: list[dict], target: float) -> float:
    for i, reward in enumerate(moving_reward(metrics)):
        if i + 1 >= WINDOW and reward >= target:
            return metrics[i]["time"]
    return math.inf


def summary(m: list[dict], target: float) -> dict:
    warm = len(m) // 5
    return {
        "tokens_per_s": effective_throughput(m),
        "to_target_s": time_to_target(m, target),
        "wall_s": m[-1]["time"],
        "final_reward": statistics.mean(x["reward/mean"] for x in m[-warm:]),
        "staleness": statistics.mean(x["staleness/mean"] for x in m),
    }


def plot(runs: dict[str, list[list[dict]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for color, (name, ms) in zip(("tab:blue", "tab:orange"), runs.items(), strict=False):
        for r, m in enumerate(ms):
            label = name if r == 0 else None
            ax.plot([x["time"] for x in m], moving_reward(m), color=color, label=label, lw=1.2)
    ax.axhline(target, color="grey", ls="--", lw=0.8, label=f"target {target:+.1f}")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(f"reward (mean of the last {WINDOW} steps)")
    ax.set_title("Asynchronous against synchronous RL")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=TINY)
    parser.add_argument(
        "--max-staleness", type=int, default=4, help="max_staleness of the async run"
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--target-reward", type=float, default=0.0)
    parser.add_argument("--png", type=Path, help="reward against wall time, every run")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both runs")
    args = parser.parse_args()
    asynchronous, synchronous = f"async max_staleness={args.max_staleness}", "sync max_staleness=0"
    variants = {
        asynchronous: [f"max_staleness={args.max_staleness}"],
        synchronous: ["max_staleness=0"],
    }
    runs: dict[str, list[list[dict]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.repeats):
            for name, extra in variants.items():  # interleaved: both see the same machine
                tag = name.split()[0] + str(r)
                m = train_tiny(root, tag, args.steps, [*extra, *args.overrides], args.config)
                runs[name].append(m)
                print(f"  repeat {r}: {name}: {summary(m, args.target_reward)}", flush=True)
    med = medians({v: [summary(m, args.target_reward) for m in ms] for v, ms in runs.items()})
    print(
        f"{'variant':<22} {'train tok/s':>12} {'wall s':>8} "
        f"{'s to reward ' + format(args.target_reward, '+.1f'):>17} {'final reward':>13} "
        f"{'staleness':>10}"
    )
    for v, m in med.items():
        print(
            f"{v:<22} {m['tokens_per_s']:>12.1f} {m['wall_s']:>8.1f} {m['to_target_s']:>17.1f} "
            f"{m['final_reward']:>+13.2f} {m['staleness']:>10.2f}"
        )
    if args.png:
        plot(runs, args.target_reward, args.png)
    a, s = med[asynchronous], med[synchronous]
    print(
        f"sync/async wall time to reward {args.target_reward:+.1f}: "
        f"{s['to_target_s'] / a['to_target_s']:.2f}x"
    )
    print(f"async/sync effective training throughput: {a['tokens_per_s'] / s['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
