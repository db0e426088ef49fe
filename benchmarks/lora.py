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
server's update_weights: copy, or base + adapter merge). It prints: peak RSS (GiB) during the
steps (VmHWM reset after the model is loaded; loading reads the whole checkpoint file, whose
pages count too: that peak is printed apart), trainer
tokens/s (all tokens of the batch per second of the median step), the version's bytes, and
publish and load times (ms) of a second version (published untrained: bytes and times do
not depend on the values; the engine in --engine-dtype) (a LoRA engine copies the weights that
adapters change at its first adapter: "first"); then LoRA / full ratios side by side.

Shapes: 4m (hidden 256, 4 layers: benchmarks/trainer.py's) and 1.5b (DeepSeek-R1-Distill-
Qwen-1.5B's, random weights, benchmarks/shapes.py). Full fine-tuning of the 1.5b shape needs
16 bytes a parameter (24.7 GB) before activations: more than this machine's 24 GB, so it is
not run unless --full-1.5b (its figures are then computed, not measured, in the table).
"""

from __future__ import annotations

import argparse
import gc
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


def _vm_hwm_gib() -> float:
    """This process's peak resident memory since the last reset (/proc/self/status VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def make_backend(args: argparse.Namespace):
    from areal.lora import LoRASpec
    from areal.trainer.optimizer import OptimizerSpec
    from areal.trainer.torch_backend import TorchBackend

    lora = LoRASpec(args.rank, 2.0 * args.rank) if args.variant == "lora" else None
    dtype = args.lora_dtype if lora else "float32"
    opt = OptimizerSpec(
        lr=1e-5, weight_decay=0.0, betas=(0.9, 0.95), adam_eps=1e-8, grad_clip=1.0, warmup_steps=1
    )
    return TorchBackend.from_dir(args.model, optimizer=opt, device="cpu", lora=lora, dtype=dtype)


def run_train(args: argparse.Namespace) -> dict:
    """--steps PPO steps of one variant in this process: peak RSS, tokens/s."""
    from areal.trainer.ppo_config import PPOConfig
    from areal.trainer.step import train_step

    sys.path.insert(0, str(HERE))
    from trainer import make_trajectories

    backend = make_backend(args)
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the steps' own peak next
    vocab = backend.model.config.vocab_size
    trajs = make_trajectories(args.n_seqs, min(vocab, 512), f"even{args.answer_len}", seed=0)
    n_tokens = sum(len(t.prompt_ids) + len(t.output_ids) for t in trajs)
    step_kw = dict(ppo=PPOConfig(n_minibatches=args.n_minibatches), max_tokens_per_mb=4096)
    times = []
    for r in range(args.steps):
        t0 = time.perf_counter()
        train_step(backend, trajs, seed=r, **step_kw)
        times.append(time.perf_counter() - t0)
    return {
        "trainable": sum(p.numel() for p in backend.trainable),
        "peak_rss_gib": _vm_hwm_gib(),
        "load_peak_rss_gib": load_peak,
        "tok_s": n_tokens / statistics.median(times),
        "step_s": times,
    }


def run_handoff(args: argparse.Namespace) -> dict:
    """Two versions of one variant published (no training: the bytes and times do not depend
    on the values) and loaded in place by a DecodeEngine in --engine-dtype."""
    from areal.lora import lora_layers
    from areal.rollout.engine import DecodeEngine
    from areal.weights import publish

    backend = make_backend(args)
    with torch.no_grad():  # a trained adapter: B != 0
        for layer in lora_layers(backend.model).values():
            layer.lora_B.normal_(0, 1e-3)
    exp = Path(args.exp)
    paths, publish_ms = [], []
    for v in (1, 2):  # the second of each is the steady state (a LoRA engine copies its
        t0 = time.perf_counter()  # base at the first adapter)
        paths.append(publish(exp, v, backend.save_hf))
        publish_ms.append(1e3 * (time.perf_counter() - t0))
    nbytes = sum(p.stat().st_size for p in paths[0].iterdir())
    del backend
    engine = DecodeEngine.from_dir(args.model, dtype=getattr(torch, args.engine_dtype))
    load_ms = []
    for v, path in enumerate(paths, 1):
        t0 = time.perf_counter()
        ok, message, _ = engine.update_weights(str(path), weight_version=v)
        load_ms.append(1e3 * (time.perf_counter() - t0))
        assert ok, message
    return {"bytes": nbytes, "publish_ms": publish_ms[-1], "load_ms": load_ms[-1],
            "first_load_ms": load_ms[0]}  # fmt: skip


def child(args: argparse.Namespace, phase: str, variant: str, model: Path, per: dict) -> dict:
    with tempfile.TemporaryDirectory(dir=args.dir) as exp:
        cmd = [sys.executable, __file__, "--phase", phase, "--variant", variant,
               "--model", str(model), "--exp", exp, "--rank", str(args.rank),
               "--lora-dtype", args.lora_dtype, "--engine-dtype", per["engine_dtype"],
               "--steps", str(args.steps), "--threads", str(args.threads),
               "--n-seqs", str(per["n_seqs"]), "--answer-len", str(per["answer_len"]),
               "--n-minibatches", str(per["n_minibatches"])]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if out.returncode:
            sys.exit(f"{model.name} {variant} {phase} exited {out.returncode}:\n"
                     f"{out.stderr[-3000:]}")  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])


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
    parser.add_argument("--engine-dtype", default="", help="'': float32 for 4m, bf16 for 1.5b")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--exp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:  # a child: one phase of one variant
        torch.set_num_threads(args.threads)
        print(json.dumps((run_train if args.phase == "train" else run_handoff)(args)))
        return

    rows = []
    for shape in args.shapes.split(","):
        big = shape == "1.5b"
        model = make_model(shape, Path(args.dir) / f"lora-bench-{shape}")
        per = dict(
            n_seqs=args.n_seqs or (4 if big else 64),
            answer_len=args.answer_len or (64 if big else 128),
            n_minibatches=args.n_minibatches or (1 if big else 4),
            engine_dtype=args.engine_dtype or ("bfloat16" if big else "float32"),
        )
        results = {}
        for variant in ("lora", "full"):
            r = results[variant] = {}
            if not (variant == "full" and big and not args.full_big):
                r.update(child(args, "train", variant, model, per))
            r.update(child(args, "handoff", variant, model, per))
            train = (f"trainable {r['trainable'] / 1e6:8.2f}M  peak {r['peak_rss_gib']:6.2f} GiB "
                     f"(load {r['load_peak_rss_gib']:.2f})  "
                     f"{r['tok_s']:8.1f} tok/s (steps {[round(t, 1) for t in r['step_s']]})"
                     if "tok_s" in r else "training not run")  # fmt: skip
            print(f"{shape:>5} {variant:<5} {train}  version {r['bytes'] / 2**20:9.2f} MiB  "
                  f"publish {r['publish_ms']:8.0f} ms  load {r['load_ms']:8.0f} ms "
                  f"(first {r['first_load_ms']:.0f})", flush=True)  # fmt: skip
        rows.append((shape, per, results))

    print(f"\n{'shape':>5} {'':<6}{'peak GiB':>9} {'tok/s':>8} {'version MiB':>12} "
          f"{'publish ms':>11} {'load ms':>8}")  # fmt: skip
    for shape, _per, results in rows:
        for variant, r in results.items():
            peak = f"{r['peak_rss_gib']:9.2f} {r['tok_s']:8.1f}" if "tok_s" in r else f"{'-':>18}"
            print(f"{shape:>5} {variant:<6}{peak} {r['bytes'] / 2**20:12.2f} "
                  f"{r['publish_ms']:11.0f} {r['load_ms']:8.0f}")  # fmt: skip
        lo, fu = results["lora"], results["full"]
        train = (f"{lo['peak_rss_gib'] / fu['peak_rss_gib']:9.2f} {lo['tok_s'] / fu['tok_s']:8.2f}"
                 if "tok_s" in fu else f"{'-':>18}")  # fmt: skip
        print(f"{shape:>5} {'ratio':<6}{train} {fu['bytes'] / lo['bytes']:11.0f}x "
              f"{fu['publish_ms'] / lo['publish_ms']:10.1f}x "
              f"{fu['load_ms'] / lo['load_ms']:7.1f}x   (lora/full; full/lora)")  # fmt: skip
        if "tok_s" not in fu:
            print(f"{shape:>5} full training not run: weights, gradients and Adam's two moments "
                  f"in float32 are 16 bytes a parameter, {16 * 1.777e9 / 1e9:.1f} GB before "
                  "activations (--full-1.5b runs it)")  # fmt: skip


if __name__ == "__main__":
    main()
