"""Every recipe against staleness, and the approximate proximal pass against the exact one.

    python benchmarks/algorithms.py [--config configs/tiny.yaml] [--recipes areal,grpo,...]
        [--max-staleness 0 4 16] [--seeds 2] [--steps 60] [--target 1.0] [--png FILE]
        [key=value ...]
    python benchmarks/algorithms.py --prox [--repeats 5] [--n-minibatches 4]

Recipes: each recipe (ppo.recipe, RECIPES in areal/trainer/ppo_config.py) trains the config
at each value of --max-staleness (the config's max_staleness, the paper's eta), one run per
seed, as `python -m areal.train` in a temporary file root; runs are interleaved so that
every recipe sees the same machine. Prints per recipe and max_staleness the medians over
seeds of the final reward (mean reward/mean over the last tenth of the steps), the wall time
until the 10-step moving mean of the reward first reaches --target ("-" if never), and the
effective throughput (tiny_run.effective_throughput), then each recipe's final reward
against the areal recipe's. --png draws the final reward against max_staleness, one line per
recipe. Rewards are rollout/reward_mean where a run has it (every finished group, also those
dynamic sampling dropped), else reward/mean.

--prox: one training step (benchmarks/trainer.py's 4M-parameter Qwen2, 64 long-tailed
sequences) with the exact proximal pass (ppo.prox_approx=none), with upstream AReaL's
log-linear approximation (loglinear: no proximal forward), and exact with a reference
model (ppo.kl_coef=0.04: its forward pass is the KL's cost), interleaved, one thread; the
median tokens/s of each and their ratios to the exact step, and the largest gap the
approximation leaves on the first minibatch (where theta is the proximal policy, so the
gap is exact; the benchmark's behaviour log-probs are random, a run's are the model's).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tiny_run import TINY, effective_throughput, train_tiny

from areal.trainer.ppo_config import RECIPES


def reward(x: dict) -> float:
    """A step's reward over what was generated: with dynamic sampling the trained batch's
    reward/mean counts only the groups kept, rollout/reward_mean every finished group."""
    return x.get("rollout/reward_mean", x["reward/mean"])


def time_to_target(m: list[dict], target: float, window: int = 10) -> float:
    rewards = [reward(x) for x in m]
    for i in range(window, len(m) + 1):
        if statistics.mean(rewards[i - window : i]) >= target:
            return m[i - 1]["time"]
    return float("inf")


def summary(m: list[dict], target: float) -> dict:
    last = max(1, len(m) // 10)
    return {
        "final_reward": statistics.mean(reward(x) for x in m[-last:]),
        "time_to_target": time_to_target(m, target),
        "tokens_per_s": effective_throughput(m),
        "wall_s": m[-1]["time"],
    }


def plot(
    table: dict[tuple[str, int], dict],
    recipes: list[str],
    bounds: list[int],
    path: Path,
    task: str,
) -> None:
    """The final reward against max_staleness (each of `bounds`), one line per recipe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in recipes:
        ax.plot([str(b) for b in bounds], [table[r, b]["final_reward"] for b in bounds],
                marker="o", label=r)  # fmt: skip
    ax.set_xlabel("max_staleness")
    ax.set_ylabel("final reward (median over seeds)")
    ax.set_title(f"Which objectives survive staleness ({task})")
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def recipes_main(args: argparse.Namespace) -> None:
    recipes = args.recipes.split(",") if args.recipes else list(RECIPES)
    config = args.config.resolve()  # the runs start in the repository root
    bounds = args.max_staleness
    runs: dict[tuple[str, int], list[dict]] = {(r, b): [] for r in recipes for b in bounds}
    with tempfile.TemporaryDirectory() as root:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for max_staleness in bounds:
                for r in recipes:  # interleaved: every recipe sees the same machine
                    extra = [f"ppo.recipe={r}", f"max_staleness={max_staleness}", f"seed={seed}"]
                    m = train_tiny(root, f"{r}-e{max_staleness}-s{seed}", args.steps,
                                   extra + args.overrides, config)  # fmt: skip
                    runs[r, max_staleness].append(summary(m, args.target))
                    print(f"  {r} max_staleness={max_staleness} seed={seed}: "
                          f"{runs[r, max_staleness][-1]}", flush=True)  # fmt: skip
    table = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in runs.items()}
    print(f"\n{'recipe':<14} {'max_staleness':>13} {'final reward':>13} {'to target (s)':>14} "
          f"{'tok/s':>8}")  # fmt: skip
    for r in recipes:
        for max_staleness in bounds:
            t = table[r, max_staleness]
            ttt = "-" if t["time_to_target"] == float("inf") else f"{t['time_to_target']:.1f}"
            print(f"{r:<14} {max_staleness:>13} {t['final_reward']:>+13.2f} {ttt:>14} "
                  f"{t['tokens_per_s']:>8.0f}")  # fmt: skip
    if "areal" in recipes:
        for max_staleness in bounds:
            base = table["areal", max_staleness]["final_reward"]
            diffs = ", ".join(f"{r} {table[r, max_staleness]['final_reward'] - base:+.2f}"
                              for r in recipes if r != "areal")  # fmt: skip
            print(f"final reward against areal's, max_staleness={max_staleness}: {diffs}")
    if args.png:
        plot(table, recipes, bounds, args.png, config.stem)


def prox_main(args: argparse.Namespace) -> None:
    import torch
    from trainer import make_model, make_trajectories

    from areal.trainer.optimizer import OptimizerSpec
    from areal.trainer.ppo_config import PPOConfig
    from areal.trainer.step import train_step
    from areal.trainer.torch_backend import TorchBackend

    torch.set_num_threads(1)
    opt = OptimizerSpec(
        lr=1e-6, weight_decay=0.0, betas=(0.9, 0.95), adam_eps=1e-5, grad_clip=1.0, warmup_steps=0
    )
    kw = dict(optimizer=opt, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model")
        backends = {
            v: TorchBackend.from_dir(model_dir, **kw) for v in ("none", "loglinear", "none+ref")
        }
        ref = TorchBackend.from_dir(model_dir, **kw)
    vocab = backends["none"].model.config.vocab_size
    trajs = make_trajectories(64, vocab, "longtail", seed=0, median=100, sigma=1.3)
    for k, t in enumerate(trajs):  # stale samples: versions 0..3 behind the trainer's 4
        t.versions = [k % 4] * len(t.output_ids)
    n_tokens = sum(len(t.prompt_ids) + len(t.output_ids) for t in trajs)
    times: dict[str, list[float]] = {v: [] for v in backends}
    gaps = []
    for r in range(args.repeats + 1):  # the first is a warm-up
        for v, backend in backends.items():
            kl = 0.04 if v.endswith("+ref") else 0.0
            ppo = PPOConfig(prox_approx=v.removesuffix("+ref"), n_minibatches=args.n_minibatches,
                            kl_coef=kl)  # fmt: skip
            t0 = time.perf_counter()
            stats = train_step(
                backend, trajs, ppo=ppo, max_tokens_per_mb=4096, seed=r, version=4, ref=ref
            )
            if r:
                times[v].append(time.perf_counter() - t0)
            if v == "loglinear" and r:
                gaps.append(stats["train/prox_approx_gap_max"])
    tput = {v: n_tokens / statistics.median(t) for v, t in times.items()}
    n_params = sum(p.numel() for p in backends["none"].model.parameters())
    print(
        f"Qwen2 {n_params / 1e6:.1f}M params, {len(trajs)} sequences, {n_tokens} tokens, "
        f"{args.n_minibatches} minibatches, 1 thread, medians of {args.repeats}"
    )
    for v in backends:
        print(f"prox_approx={v:<10} {tput[v]:8.0f} tokens/s  steps: "
              + ", ".join(f"{t:.2f}" for t in times[v]))  # fmt: skip
    print(f"loglinear / exact: {tput['loglinear'] / tput['none']:.2f}x; largest gap to the "
          f"exact proximal log-prob (first minibatch): {statistics.median(gaps):.3g}")  # fmt: skip
    print(f"exact with the reference model / exact: {tput['none+ref'] / tput['none']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=TINY)
    parser.add_argument("--recipes", default="", help="comma-separated; default: all")
    parser.add_argument("--max-staleness", type=int, nargs="+", default=[0, 4, 16])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--target", type=float, default=1.0, help="reward for time-to-target")
    parser.add_argument("--png", type=Path)
    parser.add_argument("--prox", action="store_true", help="prox_approx against exact")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n-minibatches", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = parser.parse_args()
    prox_main(args) if args.prox else recipes_main(args)


if __name__ == "__main__":
    main()
