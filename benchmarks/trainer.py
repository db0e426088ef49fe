"""One PPO step's tokens/s: packed micro-batches without a [T, T] mask against padded ones.

    python benchmarks/trainer.py [--lengths even64,even128,longtail] [--n-seqs 64]
        [--repeats 3] [--median-len 100] [--no-dense]

The trainer's own step (`areal.trainer.step.train_step`: proximal log-probs, then
ppo.n_minibatches updates) with a TorchBackend on a random Qwen2 of ~4M parameters
(hidden 256, intermediate 1024, 4 layers, 8 heads / 4 KV heads), on one batch per
geometry of --lengths:

- even64 / even128: prompts of 16..24 tokens (~20), every answer 64 (128) tokens: lengths
  differ by the prompt only (near-even: padding wastes 4% / 2% of the tokens, and packed
  attention pays one call per distinct length);
- longtail: prompts of 16..47 tokens, lognormal answer lengths (median --median-len,
  spread --sigma) clipped to 10..1500, where padding wastes most.

All variants get the same trajectories and the same dynamic micro-batches; only the
forward of a micro-batch differs:

- packed: the backend as it is, one padding-free stream per micro-batch, attention per run
  of equal lengths or per padded bucket of near-equal ones, as its cost model picks
  (areal/trainer/packed_attention.py): cost ~ sum of L_i^2;
- padded: the usual transformers way, the micro-batch right-padded to its longest
  sequence with an attention mask (stock SDPA), cost ~ n * L_max (and n * L_max^2); like
  packed, it computes no logits for prompt positions (TRL's logits_to_keep).
  First-fit micro-batches mix long and short sequences, where padding costs the most;
  benchmarks/micro_batching.py pads fixed-count micro-batches in data order instead;
- dense (unless --no-dense): the former packed path, one stream with a dense block-diagonal
  [T, T] mask, cost ~ T^2, and every position's logits.

Tokens/s counts every token of the batch (prompt and output) per second of the whole step;
medians over --repeats, the variants interleaved so that all see the same machine, after
one warm-up step each on a small batch. A table per geometry, then a summary: packed and
padded tokens/s side by side with their ratio, one line per geometry. The (CPU) columns
time the same steps by the process's CPU time instead of the wall clock: on a machine
shared with other work the wall clock swings by tens of percent from step to step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from areal.models.tiny import build_tokenizer, tiny_config
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.ppo_config import PPOConfig
from areal.trainer.step import train_step
from areal.trainer.torch_backend import TorchBackend
from areal.trajectory import Trajectory


def make_model(out: Path, seed: int = 0) -> Path:
    """A random ~4M-parameter Qwen2 with the project's offline tokenizer."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(seed)
    config = tiny_config(tokenizer, hidden=256, layers=4)
    config.intermediate_size, config.num_attention_heads, config.num_key_value_heads = 1024, 8, 4
    config.max_position_embeddings = 2048
    Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


class PaddedBackend(TorchBackend):
    """Each micro-batch right-padded to its longest sequence, with a padding mask."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model.set_attn_implementation("sdpa")

    def logprobs(self, seqs, starts=None):
        lens = torch.tensor([len(s) for s in seqs])
        input_ids = torch.full((len(seqs), int(lens.max())), self.model.config.pad_token_id)
        attention_mask = torch.zeros_like(input_ids)
        for b, s in enumerate(seqs):
            input_ids[b, : len(s)] = torch.tensor(s)
            attention_mask[b, : len(s)] = 1
        # Like the packed backend, no logits before `starts` (TRL's logits_to_keep), so that
        # only the layout differs.
        pos = torch.arange(input_ids.shape[1])[None]
        in_stream = pos < lens[:, None] - 1
        first = torch.tensor(starts if starts is not None else [0] * len(seqs))
        scored = in_stream & (pos >= first[:, None])  # [B, L_max]
        logits = self.model(
            input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=scored
        ).logits  # [scored, V]
        labels = torch.roll(input_ids, -1, 1)[scored]
        token_lp = torch.log_softmax(logits.float() / self.temperature, -1)
        token_lp = token_lp.gather(1, labels[:, None])[:, 0]
        every = torch.zeros(input_ids.shape, dtype=token_lp.dtype).index_put((scored,), token_lp)
        return every[in_stream]


class DenseMaskBackend(TorchBackend):
    """The former packed path: one stream, a dense block-diagonal causal [T, T] mask."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model.set_attn_implementation("sdpa")

    def logprobs(self, seqs, starts=None):  # every position's logits, as it was
        lens = torch.tensor([len(s) for s in seqs])
        input_ids = torch.tensor([t for s in seqs for t in s])
        position_ids = torch.cat([torch.arange(n) for n in lens.tolist()])
        seg = torch.repeat_interleave(torch.arange(len(seqs)), lens)
        total = len(input_ids)
        causal = torch.ones(total, total, dtype=torch.bool).tril()
        mask = ((seg[:, None] == seg[None, :]) & causal)[None, None]  # [1, 1, T, T]
        logits = self.model(
            input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=mask
        ).logits[0]
        logits = logits.float() / self.temperature
        token_lp = torch.log_softmax(logits, -1).gather(1, torch.roll(input_ids, -1)[:, None])
        keep = torch.ones(total, dtype=torch.bool)
        keep[torch.cumsum(lens, 0) - 1] = False
        return token_lp[:, 0][keep]


def output_lengths(geometry: str, n: int, median: float, sigma: float, rng) -> list[int]:
    """Answer lengths of one geometry: fixed for evenN, lognormal for longtail."""
    if geometry.startswith("even"):
        return [int(geometry[len("even") :])] * n
    if geometry == "longtail":
        return np.clip(rng.lognormal(np.log(median), sigma, n), 10, 1500).astype(int).tolist()
    raise ValueError(f"unknown geometry {geometry!r}: evenN (N answer tokens) or longtail")


def make_trajectories(
    n: int, vocab: int, geometry: str, seed: int, median: float = 100, sigma: float = 1.3
):
    rng = np.random.default_rng(seed)
    trajs = []
    # longtail keeps its former prompts of 16..47 tokens: the same batch as before.
    longest_prompt = 48 if geometry == "longtail" else 25
    for i, n_out in enumerate(output_lengths(geometry, n, median, sigma, rng)):
        prompt = rng.integers(vocab, size=int(rng.integers(16, longest_prompt))).tolist()
        output = rng.integers(vocab, size=n_out).tolist()
        trajs.append(
            Trajectory(
                group_id=i // 8,
                prompt_ids=prompt,
                output_ids=output,
                logprobs=(-rng.exponential(3.0, n_out)).tolist(),
                versions=[0] * n_out,
                reward=float(rng.choice([-5.0, 5.0])),
            )
        )
    return trajs


def time_geometry(
    backends: dict, trajs: list, step_kw: dict, repeats: int
) -> dict[str, dict[str, float]]:
    """Each variant's tokens/s by the median step time, of the wall clock and of the process's
    CPU time (what the step costs its thread(s), less sensitive to a shared machine's other
    load), the variants interleaved."""
    n_tokens = sum(len(t.prompt_ids) + len(t.output_ids) for t in trajs)
    times: dict[str, dict[str, list[float]]] = {v: {"wall": [], "cpu": []} for v in backends}
    for r in range(repeats):
        for v, backend in backends.items():
            t0, c0 = time.perf_counter(), time.process_time()
            train_step(backend, trajs, seed=r, **step_kw)
            times[v]["wall"].append(time.perf_counter() - t0)
            times[v]["cpu"].append(time.process_time() - c0)
    tput = {v: {k: n_tokens / statistics.median(x) for k, x in t.items()} for v, t in times.items()}
    print(f"{'variant':<8} {'tokens/s':>9} {'(CPU)':>7}   step seconds")
    for v in backends:
        spread = ", ".join(f"{t:.2f}" for t in times[v]["wall"])
        print(f"{v:<8} {tput[v]['wall']:9.0f} {tput[v]['cpu']:7.0f}   {spread}")
    return tput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", default="even64,even128,longtail", help="geometries, comma-separated"
    )
    parser.add_argument("--n-seqs", type=int, default=64, help="trajectories per step")
    parser.add_argument("--median-len", type=float, default=100, help="longtail median output")
    parser.add_argument("--sigma", type=float, default=1.3, help="longtail lognormal spread")
    parser.add_argument("--max-tokens-per-mb", type=int, default=4096)
    parser.add_argument("--n-minibatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-dense", action="store_true", help="skip the dense-mask variant")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    variants = {"packed": TorchBackend, "padded": PaddedBackend}
    if not args.no_dense:
        variants["dense"] = DenseMaskBackend
    opt = OptimizerSpec(
        lr=1e-6, weight_decay=0.0, betas=(0.9, 0.95), adam_eps=1e-5, grad_clip=1.0, warmup_steps=0
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model")
        backends = {
            v: cls.from_dir(model_dir, optimizer=opt, device="cpu") for v, cls in variants.items()
        }
    vocab = backends["packed"].model.config.vocab_size
    n_params = sum(p.numel() for p in backends["packed"].model.parameters())
    step_kw = dict(
        ppo=PPOConfig(n_minibatches=args.n_minibatches),
        max_tokens_per_mb=args.max_tokens_per_mb,
    )
    print(
        f"Qwen2 {n_params / 1e6:.1f}M params; {args.n_minibatches} minibatches, "
        f"max_tokens_per_mb={args.max_tokens_per_mb}; {args.threads} thread(s); "
        f"medians of {args.repeats}"
    )
    warm = make_trajectories(8, vocab, "longtail", seed=1, median=32, sigma=0.5)
    for backend in backends.values():
        train_step(backend, warm, **step_kw)

    summary = {}
    for geometry in args.lengths.split(","):
        trajs = make_trajectories(
            args.n_seqs, vocab, geometry, seed=0, median=args.median_len, sigma=args.sigma
        )
        lens = [len(t.prompt_ids) + len(t.output_ids) for t in trajs]
        print(
            f"\n{geometry}: {len(trajs)} sequences, {sum(lens)} tokens (lengths: min "
            f"{min(lens)}, median {int(np.median(lens))}, max {max(lens)})"
        )
        summary[geometry] = time_geometry(backends, trajs, step_kw, args.repeats)

    print(f"\n{'geometry':<10} {'packed':>8} {'padded':>8} {'packed/padded':>14} {'(CPU)':>7}")
    for geometry, tput in summary.items():
        ratio = {k: tput["packed"][k] / tput["padded"][k] for k in ("wall", "cpu")}
        dense = f"  (dense {tput['dense']['wall']:.0f})" if "dense" in tput else ""
        print(
            f"{geometry:<10} {tput['packed']['wall']:8.0f} {tput['padded']['wall']:8.0f} "
            f"{ratio['wall']:13.2f}x {ratio['cpu']:6.2f}x{dense}"
        )


if __name__ == "__main__":
    main()
