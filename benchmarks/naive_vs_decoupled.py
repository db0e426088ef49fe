"""Naive PPO against decoupled PPO with stale data: a miniature of the paper's ablation.

    python benchmarks/naive_vs_decoupled.py [--steps 120] [--last 20] [--eta 4] [key=value ...]

Both variants train the tiny config with max_staleness=eta (default 4: the paper's row
where naive PPO fell to 23.3 on AIME24 while decoupled PPO held 42.2); naive PPO is
ppo.use_decoupled_loss=false, i.e. the behaviour policy stands in for the proximal one.
Each runs as `python -m areal.train` in a temporary file root. Prints the final reward of
each (mean reward/mean over the last --last steps of metrics.jsonl), the mean observed
staleness, and on its last line the difference decoupled - naive. With --seeds > 1, one
run per seed and variant, medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from tiny_run import train_tiny

VARIANTS = {"naive": "ppo.use_decoupled_loss=false", "decoupled": "ppo.use_decoupled_loss=true"}


def run(fileroot: str, name: str, steps: int, last: int, eta: int, overrides: list[str]) -> dict:
    m = train_tiny(fileroot, name, steps, [f"max_staleness={eta}", *overrides])
    return {
        "first_reward": statistics.mean(x["reward/mean"] for x in m[:last]),
        "final_reward": statistics.mean(x["reward/mean"] for x in m[-last:]),
        "staleness": statistics.mean(x["staleness/mean"] for x in m),
        "wall_s": m[-1]["time"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--last", type=int, default=20, help="steps averaged for the reward")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--eta", type=int, default=4, help="max_staleness of both runs")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both runs")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as root:
        for seed in range(1, args.seeds + 1):
            for name, flag in VARIANTS.items():  # interleaved: both see the same machine
                extra = [flag, f"seed={seed}", *args.overrides]
                results[name].append(
                    run(root, f"{name}{seed}", args.steps, args.last, args.eta, extra)
                )
    med = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in results.items()}
    print(
        f"{'variant':<10} {'first reward':>13} {'final reward':>13} {'staleness':>10} {'wall s':>7}"
    )
    for v, m in med.items():
        print(
            f"{v:<10} {m['first_reward']:>+13.2f} {m['final_reward']:>+13.2f} "
            f"{m['staleness']:>10.2f} {m['wall_s']:>7.1f}"
        )
    diff = med["decoupled"]["final_reward"] - med["naive"]["final_reward"]
    print(f"final reward, decoupled - naive (eta={args.eta}): {diff:+.2f}")


if __name__ == "__main__":
    main()
