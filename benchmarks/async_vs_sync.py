"""Asynchronous (eta = 4) against synchronous (eta = 0) RL on the tiny config, one run each.

    python benchmarks/async_vs_sync.py [--steps 60] [--repeats 1] [key=value ...]

Effective training throughput is the paper's: generated tokens consumed by PPO updates per
second of wall time, after warm-up (the first fifth of the steps is left out). Time to
target is the wall time at which the mean reward of the last 10 steps first reaches
--target-reward (inf when never). Prints both variants side by side and the ratios last;
with --repeats > 1, medians.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile

from tiny_run import effective_throughput, train_tiny


def time_to_target(metrics: list[dict], target: float, window: int = 10) -> float:
    for i in range(window, len(metrics) + 1):
        if statistics.mean(x["reward/mean"] for x in metrics[i - window : i]) >= target:
            return metrics[i - 1]["time"]
    return math.inf


def run(fileroot: str, name: str, steps: int, target: float, overrides: list[str]) -> dict:
    m = train_tiny(fileroot, name, steps, overrides)
    warm = len(m) // 5
    return {
        "tokens_per_s": effective_throughput(m),
        "to_target_s": time_to_target(m, target),
        "wall_s": m[-1]["time"],
        "final_reward": statistics.mean(x["reward/mean"] for x in m[-warm:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--target-reward", type=float, default=0.0)
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both runs")
    args = parser.parse_args()
    variants = {"async eta=4": ["max_staleness=4"], "sync eta=0": ["max_staleness=0"]}
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.repeats):
            for name, extra in variants.items():  # interleaved: both see the same machine
                tag = name.split()[0] + str(r)
                overrides = [*extra, *args.overrides]
                results[name].append(run(root, tag, args.steps, args.target_reward, overrides))
                print(f"  repeat {r}: {name}: {results[name][-1]}", flush=True)
    med = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in results.items()}
    print(
        f"{'variant':<12} {'train tok/s':>12} {'wall s':>8} "
        f"{'s to reward ' + format(args.target_reward, '+.1f'):>17} {'final reward':>13}"
    )
    for v, m in med.items():
        print(
            f"{v:<12} {m['tokens_per_s']:>12.1f} {m['wall_s']:>8.1f} {m['to_target_s']:>17.1f} "
            f"{m['final_reward']:>+13.2f}"
        )
    a, s = med["async eta=4"], med["sync eta=0"]
    print(
        f"sync/async wall time to reward {args.target_reward:+.1f}: "
        f"{s['to_target_s'] / a['to_target_s']:.2f}x"
    )
    print(f"async/sync effective training throughput: {a['tokens_per_s'] / s['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
