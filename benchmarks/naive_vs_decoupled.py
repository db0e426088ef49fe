"""Naive against decoupled PPO as staleness grows: a miniature of the paper's Table 2.

    python benchmarks/naive_vs_decoupled.py [--config configs/tiny.yaml]
        [--max-staleness 4] [--steps 120] [--last 20] [--seeds 1] [--png FILE] [key=value ...]

For each value of --max-staleness (the config's max_staleness, the paper's eta), both
variants train the config with it; naive PPO is ppo.use_decoupled_loss=false, i.e. the
behaviour policy stands in for the proximal one. (The paper, AIME24: at eta=4 naive PPO fell
to 23.3 while decoupled PPO held 42.2.) Each runs as `python -m areal.train` in a temporary
file root. Prints, per max_staleness and variant, the final reward (mean reward/mean over
the last --last steps of metrics.jsonl) and the staleness the trainer really saw
(staleness/mean), then decoupled - naive per max_staleness. With --seeds > 1, one run per
seed, max_staleness and variant, medians. --png draws the final reward against
max_staleness, one line per variant.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from tiny_run import TINY, medians, train_tiny

VARIANTS = {"naive": "ppo.use_decoupled_loss=false", "decoupled": "ppo.use_decoupled_loss=true"}


def summary(m: list[dict], last: int) -> dict:
    return {
        "first_reward": statistics.mean(x["reward/mean"] for x in m[:last]),
        "final_reward": statistics.mean(x["reward/mean"] for x in m[-last:]),
        "staleness": statistics.mean(x["staleness/mean"] for x in m),
        "wall_s": m[-1]["time"],
    }


def plot(med: dict[int, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounds = sorted(med)  # the max_staleness values
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant, marker in zip(VARIANTS, ("o", "s"), strict=True):
        ax.plot(
            [str(b) for b in bounds],
            [med[b][variant]["final_reward"] for b in bounds],
            marker=marker,
            label=f"{variant} PPO",
        )
    first = statistics.mean(med[b][v]["first_reward"] for b in bounds for v in VARIANTS)
    ax.axhline(first, color="grey", ls="--", lw=0.8, label="reward at the start")
    ax.set_xlabel("max_staleness")
    ax.set_ylabel("final reward")
    ax.set_title("Naive against decoupled PPO as staleness grows")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=TINY)
    parser.add_argument(
        "--max-staleness", type=int, nargs="+", default=[4], help="max_staleness values"
    )
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--last", type=int, default=20, help="steps averaged for the reward")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--png", type=Path, help="final reward against max_staleness, per variant")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = parser.parse_args()
    med: dict[int, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as root:
        for max_staleness in args.max_staleness:
            results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for seed in range(1, args.seeds + 1):
                for name, flag in VARIANTS.items():  # interleaved: both see the same machine
                    extra = [f"max_staleness={max_staleness}", flag, f"seed={seed}"]
                    tag = f"{name}-e{max_staleness}-s{seed}"
                    m = train_tiny(root, tag, args.steps, [*extra, *args.overrides], args.config)
                    results[name].append(summary(m, args.last))
                    print(
                        f"  max_staleness={max_staleness} seed={seed} {name}: {results[name][-1]}",
                        flush=True,
                    )
            med[max_staleness] = medians(results)
    print(
        f"{'max_staleness':>13} {'variant':<10} {'first reward':>13} {'final reward':>13} "
        f"{'staleness':>10} {'wall s':>7}"
    )
    for max_staleness, by_variant in med.items():
        for v, m in by_variant.items():
            print(
                f"{max_staleness:>13} {v:<10} {m['first_reward']:>+13.2f} "
                f"{m['final_reward']:>+13.2f} {m['staleness']:>10.2f} {m['wall_s']:>7.1f}"
            )
    if args.png:
        plot(med, args.png)
    for max_staleness, by_variant in med.items():
        diff = by_variant["decoupled"]["final_reward"] - by_variant["naive"]["final_reward"]
        print(f"final reward, decoupled - naive (max_staleness={max_staleness}): {diff:+.2f}")


if __name__ == "__main__":
    main()
