"""Dynamic micro-batching (Algorithm 1, packed) against a fixed number of padded micro-batches.

    python benchmarks/micro_batching.py [--n-seqs 64] [--repeats 5] [--fixed-n-mbs 8]
        [--lengths lognormal|longtail]

One PPO minibatch update of the tiny model's trainer (TorchBackend) on a long-tailed
distribution of sequence lengths, the same sequences for both variants: lognormal, or
--lengths longtail, the longtail task's own (areal/tasks/longtail.py: a ~20-token prompt and
10 tokens a step, the steps Pareto-distributed).

- dynamic: allocate_micro_batches under a token budget, each micro-batch one packed,
  padding-free stream (the trainer's own code path);
- padded: the minibatch cut in data order into a fixed number of micro-batches, each padded
  to its longest sequence and run with a padding attention mask (how a fixed-count trainer
  without packing works).

Both run the same loss (decoupled_ppo_loss over all output tokens), backward and optimizer
step. Throughput is real (non-padding) tokens per second of the update; medians of the
repeats, the variants interleaved so that both see the same machine. The last line is the
ratio, e.g. `1.42x`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from areal.models.tiny import make_tiny_model
from areal.tasks import longtail
from areal.trainer.micro_batches import allocate_micro_batches
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.ppo import decoupled_ppo_loss
from areal.trainer.step import proximal_logprobs
from areal.trainer.torch_backend import TorchBackend


def lognormal_lengths(n: int, median: float, sigma: float, lo: int, hi: int, seed: int):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), sigma, n), lo, hi).astype(int).tolist()


def longtail_lengths(n: int, prompt_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [prompt_len + longtail.TOKENS_PER_STEP * longtail.draw_steps(rng) for _ in range(n)]


def padded_logprobs(backend: TorchBackend, seqs) -> torch.Tensor:
    """The backend's log-prob stream computed the padded way: [B, L_max] with a mask."""
    lens = [len(s) for s in seqs]
    width = max(lens)
    pad = backend.model.config.pad_token_id
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.int64)
    attention_mask = torch.zeros(len(seqs), width, dtype=torch.int64)
    for b, s in enumerate(seqs):
        input_ids[b, : len(s)] = torch.tensor(s)
        attention_mask[b, : len(s)] = 1
    input_ids, attention_mask = input_ids.to(backend.device), attention_mask.to(backend.device)
    logits = backend.model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, :-1].float() / backend.temperature  # [B, L_max-1, V]
    token_lp = torch.log_softmax(logits, -1).gather(2, input_ids[:, 1:, None])[..., 0]
    # Right padding: row b's real predictions are its first len-1 positions.
    return torch.cat([token_lp[b, : n - 1] for b, n in enumerate(lens)])


def update(backend, seqs, tokens, micro_batches, forward) -> None:
    """One minibatch update: loss over all output tokens, normalised by their count."""
    n_valid = sum(int(t["mask"].sum()) for t in tokens)
    for mb in micro_batches:
        lp = forward(backend, [seqs[i] for i in mb])
        cat = {k: torch.cat([tokens[i][k] for i in mb]) for k in ("prox", "mask", "adv")}
        loss, _ = decoupled_ppo_loss(
            lp, cat["prox"], cat["prox"], cat["adv"], cat["mask"], n_valid_tokens=n_valid
        )
        loss.backward()
    backend.optimizer_step()


def make_batch(backend, lens, prompt_len: int, budget: int, seed: int):
    """Random sequences with the model's own log-probs as proximal (= behaviour) policy."""
    gen = torch.Generator().manual_seed(seed)
    vocab = backend.model.config.vocab_size
    seqs = [torch.randint(vocab, (n,), generator=gen).tolist() for n in lens]
    prox = proximal_logprobs(backend, seqs, budget)
    adv = torch.randn(len(seqs), generator=gen)
    tokens = []
    for n, p, a in zip(lens, prox, adv, strict=True):
        mask = torch.zeros(n - 1)
        mask[prompt_len - 1 :] = 1.0
        tokens.append({"prox": p, "mask": mask, "adv": torch.full((n - 1,), float(a))})
    return seqs, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-seqs", type=int, default=64, help="sequences per minibatch")
    parser.add_argument("--lengths", choices=("lognormal", "longtail"), default="lognormal")
    parser.add_argument("--median-len", type=float, default=48)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal spread")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-tokens-per-mb", type=int, default=1024)
    parser.add_argument("--fixed-n-mbs", type=int, default=8, help="padded variant's count")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompt_len = 16
    if args.lengths == "longtail":
        prompt_len = 20
        lens = longtail_lengths(args.n_seqs, prompt_len, seed=0)
    else:
        lens = lognormal_lengths(
            args.n_seqs, args.median_len, args.sigma, prompt_len + 2, args.max_len, seed=0
        )
    n_tokens = sum(lens)

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(
            Path(tmp) / "model", hidden=args.hidden, layers=args.layers, warmup_steps=0
        )
        opt = OptimizerSpec(
            lr=1e-5, weight_decay=0.0, betas=(0.9, 0.95), adam_eps=1e-5, grad_clip=1.0,
            warmup_steps=0,
        )  # fmt: skip
        backends = {v: TorchBackend.from_dir(model, optimizer=opt) for v in "dp"}
    seqs, tokens = make_batch(backends["d"], lens, prompt_len, args.max_tokens_per_mb, seed=0)
    plans = {
        "d": allocate_micro_batches(lens, args.max_tokens_per_mb),
        "p": [c.tolist() for c in np.array_split(np.arange(len(lens)), args.fixed_n_mbs)],
    }
    forwards = {"d": TorchBackend.logprobs, "p": padded_logprobs}
    # The two forwards compute the same thing: same work, different layout.
    with torch.no_grad():
        check = seqs[:4]
        diff = (forwards["d"](backends["d"], check) - padded_logprobs(backends["p"], check)).abs()
        assert diff.max() < 1e-3, diff.max()
    padded_tokens = sum(len(mb) * max(lens[i] for i in mb) for mb in plans["p"])
    print(
        f"{args.n_seqs} sequences, {n_tokens} tokens (lengths: median {int(np.median(lens))}, "
        f"max {max(lens)}); model hidden {args.hidden}, {args.layers} layers"
    )
    print(
        f"dynamic: {len(plans['d'])} packed micro-batches of <= {args.max_tokens_per_mb} tokens; "
        f"padded: {args.fixed_n_mbs} micro-batches holding {padded_tokens} tokens with padding"
    )

    times: dict[str, list[float]] = {"d": [], "p": []}
    for r in range(args.repeats + 1):  # the first round warms up allocators and caches
        for v in "dp":
            t0 = time.perf_counter()
            update(backends[v], seqs, tokens, plans[v], forwards[v])
            if r:
                times[v].append(time.perf_counter() - t0)
    tput = {v: n_tokens / statistics.median(times[v]) for v in "dp"}
    for v, name in (("d", "dynamic (packed)"), ("p", f"fixed {args.fixed_n_mbs} (padded)")):
        spread = ", ".join(f"{t:.2f}" for t in times[v])
        print(f"{name:<20} {tput[v]:9.1f} tokens/s   (update seconds: {spread})")
    print(f"{tput['d'] / tput['p']:.2f}x")


if __name__ == "__main__":
    main()
