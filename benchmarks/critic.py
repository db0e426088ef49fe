"""What the critic costs the trainer: one PPO step's tokens/s without and with it.

    python benchmarks/critic.py [--lengths even64,longtail] [--n-seqs 64] [--repeats 5]

The trainer's own step (`areal.trainer.step.train_step`) on the random ~4M-parameter Qwen2
of benchmarks/trainer.py, the same trajectories for both variants:

- policy: ppo.recipe=areal (the paper's: proximal pass, then ppo.n_minibatches updates);
- critic: ppo.recipe=ppo, the same plus a TorchCritic (a copy of the model's trunk and a
  value head): a value pass over the batch, and per minibatch one forward and backward
  of the critic and its optimizer step.

It counts the passes (forwards over the batch's sequences, with and without gradients) of
each, and times the steps interleaved, medians of the wall clock and of the process's CPU
time (what the step costs its thread, less sensitive to a machine shared with other work).
Tokens/s counts every token of the batch per second of the whole step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainer import make_model, make_trajectories  # noqa: E402

from areal.trainer.critic import TorchCritic  # noqa: E402
from areal.trainer.optimizer import OptimizerSpec  # noqa: E402
from areal.trainer.ppo_config import PPOConfig  # noqa: E402
from areal.trainer.step import train_step  # noqa: E402
from areal.trainer.torch_backend import TorchBackend  # noqa: E402


class Counting:
    """Counts the sequences an object's forward sees, by whether gradients are on."""

    def __init__(self, obj, method: str):
        self.seqs = {"grad": 0, "no_grad": 0}
        inner = getattr(obj, method)

        def counted(seqs, *args, **kwargs):
            self.seqs["grad" if torch.is_grad_enabled() else "no_grad"] += len(seqs)
            return inner(seqs, *args, **kwargs)

        setattr(obj, method, counted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="even64,longtail", help="geometries, comma-separated")
    parser.add_argument("--n-seqs", type=int, default=64, help="trajectories per step")
    parser.add_argument("--max-tokens-per-mb", type=int, default=4096)
    parser.add_argument("--n-minibatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    opt = OptimizerSpec(
        lr=1e-6, weight_decay=0.0, betas=(0.9, 0.95), adam_eps=1e-5, grad_clip=1.0, warmup_steps=0
    )
    kw = dict(optimizer=opt, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model")
        policies = {v: TorchBackend.from_dir(model_dir, **kw) for v in ("policy", "critic")}
        critic = TorchCritic.from_dir(model_dir, **kw)
    counts = {v: Counting(b, "logprobs") for v, b in policies.items()}
    critic_count = Counting(critic, "values")
    step_kw = {
        "policy": dict(ppo=PPOConfig(recipe="areal", n_minibatches=args.n_minibatches)),
        "critic": dict(
            ppo=PPOConfig(recipe="ppo", n_minibatches=args.n_minibatches),
            critic=critic,
            value_clip=0.2,
        ),
    }
    vocab = policies["policy"].model.config.vocab_size
    warm = make_trajectories(8, vocab, "longtail", seed=1, median=32, sigma=0.5)
    for v, backend in policies.items():
        train_step(backend, warm, max_tokens_per_mb=args.max_tokens_per_mb, **step_kw[v])
    print(
        f"{args.n_minibatches} minibatches, max_tokens_per_mb={args.max_tokens_per_mb}; "
        f"{args.threads} thread(s); medians of {args.repeats}"
    )
    for geometry in args.lengths.split(","):
        trajs = make_trajectories(args.n_seqs, vocab, geometry, seed=0)
        n_tokens = sum(len(t.prompt_ids) + len(t.output_ids) for t in trajs)
        times = {v: {"wall": [], "cpu": []} for v in policies}
        for c in [*counts.values(), critic_count]:
            c.seqs = dict.fromkeys(c.seqs, 0)
        for r in range(args.repeats):
            for v, backend in policies.items():
                t0, c0 = time.perf_counter(), time.process_time()
                train_step(
                    backend, trajs, seed=r, max_tokens_per_mb=args.max_tokens_per_mb,
                    **step_kw[v],
                )  # fmt: skip
                times[v]["wall"].append(time.perf_counter() - t0)
                times[v]["cpu"].append(time.process_time() - c0)
        tput = {
            v: {k: n_tokens / statistics.median(x) for k, x in t.items()} for v, t in times.items()
        }  # noqa: E501
        print(f"\n{geometry}: {len(trajs)} sequences, {n_tokens} tokens")
        print(f"{'variant':<8} {'tokens/s':>9} {'(CPU)':>7}   passes over the batch per step")
        for v in policies:
            per_step = {k: n / args.repeats / len(trajs) for k, n in counts[v].seqs.items()}
            passes = f"policy fwd {per_step['no_grad']:.2f}, fwd+bwd {per_step['grad']:.2f}"
            if v == "critic":
                c = {k: n / args.repeats / len(trajs) for k, n in critic_count.seqs.items()}
                passes += f"; critic fwd {c['no_grad']:.2f}, fwd+bwd {c['grad']:.2f}"
            print(f"{v:<8} {tput[v]['wall']:9.0f} {tput[v]['cpu']:7.0f}   {passes}")
        ratio = {k: tput["critic"][k] / tput["policy"][k] for k in ("wall", "cpu")}
        print(f"critic/policy tokens/s: {ratio['wall']:.2f}x (CPU {ratio['cpu']:.2f}x)")


if __name__ == "__main__":
    main()
