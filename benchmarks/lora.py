"""LoRA against full fine-tuning: trainer memory and speed, and the per-version hand-off.

    python benchmarks/lora.py [--shapes 4m,1.5b] [--rank 16] [--steps 2] [--dir /tmp]

For each shape, each variant runs in a process of its own (its peak RSS is its own):
- full: TorchBackend as today (float32 weights, gradients and Adam's moments for every one);
- lora: model.lora rank --rank on every linear layer (alpha 2 x rank), the frozen base held
  in --lora-dtype (bfloat16: the base in bf16, forward under bf16 autocast, as
  model.dtype=bfloat16 does; float32: as the default dtype).
Each does --steps PPO steps (areal.trainer.step.train_step: proximal log-probs, then
ppo.n_minibatches updates) on the same batch (--n-seqs sequences of ~20-token prompts and
--answer-len-token answers), then publishes one version (areal.weights.publish of save_hf:
the whole model, or the adapter alone) and a DecodeEngine loads it in place (the embedded
server's update_weights: copy, or base + adapter merge). It prints: peak RSS (GiB), trainer
tokens/s (all tokens of the batch per second of the median step), the version's bytes, and
publish and load times (ms) of a second version (a LoRA engine copies the weights that
adapters change at its first adapter: "first"); then LoRA / full ratios side by side.

Shapes: 4m (hidden 256, 4 layers: benchmarks/trainer.py's) and 1.5b (DeepSeek-R1-Distill-
Qwen-1.5B's, random weights, benchmarks/shapes.py). Full fine-tuning of the 1.5b shape needs
16 bytes a parameter (24.7 GB) before activations: more than this machine's 24 GB, so it is
not run unless --full-1.5b (its figures are then computed, not measured, in the table).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def make_model(shape: str, out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    if shape == "4m":
        sys.path.insert(0, str(HERE))
        from trainer import make_model as make_4m

        return make_4m(out)
    sys.path.insert(0, str(HERE))
    from shapes import QWEN2_1P5B, save_random_qwen2

    return save_random_qwen2(out, QWEN2_1P5B, torch.float32)


def run_variant(args: argparse.Namespace) -> dict:
    """One variant in this process: steps, publish, load. Returns its figures."""
    from areal.config import PPOConfig
    from areal.lora import LoRASpec
    from areal.rollout.engine import DecodeEngine
    from areal.trainer.step import train_step
    from areal.trainer.torch_backend import TorchBackend
    from areal.weights import publish

    sys.path.insert(0, str(HERE))
    from trainer import make_trajectories

    torch.set_num_threads(args.threads)
    lora = LoRASpec(args.rank, 2.0 * args.rank) if args.variant == "lora" else None
    dtype = args.lora_dtype if lora else "float32"
    opt = dict(lr=1e-5, weight_decay=0.0, betas=(0.9, 0.95), adam_eps=1e-8, grad_clip=1.0)
    backend = TorchBackend.from_dir(
        args.model, warmup_steps=1, device="cpu", lora=lora, dtype=dtype, **opt
    )
    vocab = backend.model.config.vocab_size
    trajs = make_trajectories(args.n_seqs, min(vocab, 512), f"even{args.answer_len}", seed=0)
    n_tokens = sum(len(t.prompt_ids) + len(t.output_ids) for t in trajs)
    step_kw = dict(ppo=PPOConfig(n_minibatches=args.n_minibatches), max_tokens_per_mb=4096)
    times = []
    for r in range(args.steps):
        t0 = time.perf_counter()
        train_step(backend, trajs, seed=r, **step_kw)
        times.append(time.perf_counter() - t0)
    trainer_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    n_trainable = sum(p.numel() for p in backend.trainable)

    exp = Path(args.exp)
    paths, publish_ms = [], []
    for v in (1, 2):  # the second of each is the steady state (a LoRA engine copies its base
        t0 = time.perf_counter()  # at the first adapter)
        paths.append(publish(exp, v, backend.save_hf))
        publish_ms.append(1e3 * (time.perf_counter() - t0))
    nbytes = sum(p.stat().st_size for p in paths[0].iterdir())
    del backend
    engine = DecodeEngine.from_dir(args.model, dtype=torch.float32)
    load_ms = []
    for v, path in enumerate(paths, 1):
        t0 = time.perf_counter()
        ok, message, _ = engine.update_weights(str(path), weight_version=v)
        load_ms.append(1e3 * (time.perf_counter() - t0))
        assert ok, message
    return {
        "variant": args.variant,
        "trainable": n_trainable,
        "peak_rss_gib": trainer_rss,
        "tok_s": n_tokens / statistics.median(times),
        "step_s": times,
        "bytes": nbytes,
        "publish_ms": publish_ms[-1],
        "load_ms": load_ms[-1],
        "first_load_ms": load_ms[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4m,1.5b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--n-seqs", type=int, default=0, help="0: 64 for 4m, 4 for 1.5b")
    parser.add_argument("--answer-len", type=int, default=0, help="0: 128 for 4m, 64 for 1.5b")
    parser.add_argument("--n-minibatches", type=int, default=0, help="0: 4 for 4m, 1 for 1.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--full-1.5b", dest="full_big", action="store_true")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--exp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # a child: one variant
        print(json.dumps(run_variant(args)))
        return

    rows = []
    for shape in args.shapes.split(","):
        big = shape == "1.5b"
        model = make_model(shape, Path(args.dir) / f"lora-bench-{shape}")
        per = dict(
            n_seqs=args.n_seqs or (4 if big else 64),
            answer_len=args.answer_len or (64 if big else 128),
            n_minibatches=args.n_minibatches or (1 if big else 4),
        )
        results = {}
        for variant in ("lora", "full"):
            if variant == "full" and big and not args.full_big:
                continue
            with tempfile.TemporaryDirectory(dir=args.dir) as exp:
                cmd = [sys.executable, __file__, "--variant", variant, "--model", str(model),
                       "--exp", exp, "--rank", str(args.rank), "--lora-dtype", args.lora_dtype,
                       "--steps", str(args.steps), "--threads", str(args.threads),
                       "--n-seqs", str(per["n_seqs"]), "--answer-len", str(per["answer_len"]),
                       "--n-minibatches", str(per["n_minibatches"])]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
                if out.returncode:
                    sys.exit(f"{shape} {variant} failed:\n{out.stderr[-3000:]}")
                results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
                r = results[variant]
                print(f"{shape:>5} {variant:<5} trainable {r['trainable'] / 1e6:8.2f}M  peak "
                      f"{r['peak_rss_gib']:6.2f} GiB  {r['tok_s']:8.1f} tok/s  version "
                      f"{r['bytes'] / 2**20:9.2f} MiB  publish {r['publish_ms']:8.0f} ms  "
                      f"load {r['load_ms']:8.0f} ms (first {r['first_load_ms']:.0f})  "
                      f"(steps {[round(s, 1) for s in r['step_s']]})",
                      flush=True)  # fmt: skip
        rows.append((shape, per, results))

    print(f"\n{'shape':>5} {'':<6}{'peak GiB':>9} {'tok/s':>8} {'version MiB':>12} "
          f"{'publish ms':>11} {'load ms':>8}")  # fmt: skip
    for shape, _per, results in rows:
        for variant, r in results.items():
            mib = r["bytes"] / 2**20
            print(f"{shape:>5} {variant:<6}{r['peak_rss_gib']:9.2f} {r['tok_s']:8.1f} "
                  f"{mib:12.2f} {r['publish_ms']:11.0f} {r['load_ms']:8.0f}")  # fmt: skip
        if "full" in results:
            lo, fu = results["lora"], results["full"]
            print(f"{shape:>5} {'ratio':<6}{lo['peak_rss_gib'] / fu['peak_rss_gib']:9.2f} "
                  f"{lo['tok_s'] / fu['tok_s']:8.2f} {fu['bytes'] / lo['bytes']:11.0f}x "
                  f"{fu['publish_ms'] / lo['publish_ms']:10.1f}x "
                  f"{fu['load_ms'] / lo['load_ms']:7.1f}x   (lora/full; full/lora)")  # fmt: skip
        else:
            print(f"{shape:>5} full: not run (16 bytes/param of weights, grads and Adam in "
                  f"float32 = {16 * 1.777e9 / 1e9:.1f} GB before activations)")  # fmt: skip


if __name__ == "__main__":
    main()
