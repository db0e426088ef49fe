"""The hand-off of one weight version: the trainer publishes weights/vN, a server loads it.

    python benchmarks/handoff.py [--shapes tiny,1b] [--repeats 3] [--dir /tmp]
    python benchmarks/handoff.py --shapes 1.5b --backend megatron   # on a GPU

Publish: the trainer backend's save_hf through areal.weights.publish (safetensors + config +
tokenizer files into vN.tmp/, then an atomic rename), as the trainer does every step. Load:
two variants on the same directory, side by side:
- in place: DecodeEngine.update_weights, what the embedded server does (tensors checked by
  name and shape against the live model, copied into it between decode steps; the KV cache
  is recomputed on the next step);
- reload: AutoModelForCausalLM.from_pretrained of the directory, every weight read once,
  what a server without in-place updates would do.
Shapes: tiny (the CPU default's model: hidden 64, 2 layers) and 1b (a Qwen2 of 0.97B
parameters: hidden 2048, 20 layers, 16/4 heads, intermediate 5632, vocab 32000), fp32 on
the CPU; 1.5b (DeepSeek-R1-Distill-Qwen-1.5B's shape) in bf16 on a GPU, where the trainer
and the engine both hold their weights on the GPU (the megatron backend publishes bf16).
Medians in ms. --dir should be on the storage the experiment directory would use: the
1b publish is bound by its write speed (3.9 GB a version).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from shapes import DEVICE, QWEN2_1P5B, save_random_qwen2
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from areal.rollout.engine import DecodeEngine
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.torch_backend import TorchBackend
from areal.weights import publish

SHAPES = {
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
               num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4,
               tie_word_embeddings=True),
    "1.5b": QWEN2_1P5B,
}  # fmt: skip


def ms(start: float) -> float:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def make_trainer(model_dir: Path, backend: str, dtype: str):
    opt = OptimizerSpec(
        lr=1e-5, weight_decay=0.0, betas=(0.9, 0.95), adam_eps=1e-8, grad_clip=1.0, warmup_steps=1
    )
    if backend == "megatron":
        from areal.trainer.megatron.backend import MegatronBackend

        return MegatronBackend(model_dir, optimizer=opt, dtype=dtype, save_dtype=dtype)
    return TorchBackend.from_dir(model_dir, optimizer=opt, dtype=dtype, device=DEVICE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,1b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the versions are written")
    parser.add_argument("--backend", choices=("torch", "megatron"), default="torch")
    parser.add_argument("--dtype", default="bfloat16" if DEVICE == "cuda" else "float32")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"{where}, {args.dtype}, {args.backend} trainer, versions under {args.dir or '/tmp'}")
    print(f"{'shape':>5} {'params':>8} {'publish ms':>11} {'in-place load ms':>17} "
          f"{'reload ms':>10} {'reload/in-place':>16}")  # fmt: skip
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            model_dir = Path(root) / "model"
            save_random_qwen2(model_dir, SHAPES[shape], dtype)
            trainer = make_trainer(model_dir, args.backend, args.dtype)
            weights = list(
                (trainer.gpt if args.backend == "megatron" else trainer.model).parameters()
            )
            params = sum(p.numel() for p in weights)
            engine = DecodeEngine.from_dir(
                str(model_dir), max_batch_size=1, max_total_tokens=64, device=DEVICE, dtype=dtype
            )
            pub, inplace, reload = [], [], []
            for v in range(1, args.repeats + 1):
                with torch.no_grad():  # a new version: every weight changes
                    for p in weights:
                        p.add_(1e-3)
                start = time.perf_counter()
                path = publish(root, v, trainer.save_hf)
                pub.append(ms(start))
                start = time.perf_counter()
                ok, message, _ = engine.update_weights(str(path), v)
                inplace.append(ms(start))
                assert ok, message
                start = time.perf_counter()
                fresh = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE)
                # from_pretrained may leave weights mapped from the file: read them all, as
                # serving the first request would.
                sum(float(p.detach().sum()) for p in fresh.parameters())
                reload.append(ms(start))
                del fresh
            engine.shutdown()
        p, i, r = (statistics.median(x) for x in (pub, inplace, reload))
        print(f"{shape:>5} {params / 1e6:>7.1f}M {p:>11.0f} {i:>17.0f} {r:>10.0f} {r / i:>15.2f}x")


if __name__ == "__main__":
    main()
