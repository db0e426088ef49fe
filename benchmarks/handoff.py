"""The hand-off of one weight version: the trainer publishes weights/vN, a server loads it.

    python benchmarks/handoff.py [--shapes tiny,1b] [--repeats 3] [--dir /tmp]

Publish: the torch backend's save_hf through areal.weights.publish (safetensors + config +
tokenizer files into vN.tmp/, then an atomic rename), as the trainer does every step. Load:
two variants on the same directory, side by side:
- in place: DecodeEngine.update_weights, what the embedded server does (tensors checked by
  name and shape against the live model, copied into it between decode steps; the KV cache
  is recomputed on the next step);
- reload: AutoModelForCausalLM.from_pretrained of the directory, every weight read once,
  what a server without in-place updates would do.
Shapes: tiny (the CPU default's model: hidden 64, 2 layers) and 1b (a Qwen2 of 0.97B
parameters: hidden 2048, 20 layers, 16/4 heads, intermediate 5632, vocab 32000), fp32.
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
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from areal.rollout.engine import DecodeEngine
from areal.trainer.torch_backend import TorchBackend
from areal.weights import publish

SHAPES = {
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
               num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4),
}  # fmt: skip


def ms(start: float) -> float:
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,1b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the versions are written")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    print(f"{'shape':>5} {'params':>8} {'publish ms':>11} {'in-place load ms':>17} "
          f"{'reload ms':>10} {'reload/in-place':>16}")  # fmt: skip
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            model_dir = Path(root) / "model"
            torch.manual_seed(0)
            config = Qwen2Config(tie_word_embeddings=True, **SHAPES[shape])
            Qwen2ForCausalLM(config).save_pretrained(model_dir)
            trainer = TorchBackend(
                model_dir, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.95), adam_eps=1e-8,
                grad_clip=1.0, warmup_steps=1, device="cpu",
            )  # fmt: skip
            params = sum(p.numel() for p in trainer.model.parameters())
            engine = DecodeEngine(str(model_dir), max_batch_size=1, max_total_tokens=64)
            pub, inplace, reload = [], [], []
            for v in range(1, args.repeats + 1):
                with torch.no_grad():  # a new version: every weight changes
                    for p in trainer.model.parameters():
                        p.add_(1e-3)
                start = time.perf_counter()
                path = publish(root, v, trainer.save_hf)
                pub.append(ms(start))
                start = time.perf_counter()
                ok, message, _ = engine.update_weights(str(path), v)
                inplace.append(ms(start))
                assert ok, message
                start = time.perf_counter()
                fresh = AutoModelForCausalLM.from_pretrained(path)
                # from_pretrained may leave weights mapped from the file: read them all, as
                # serving the first request would.
                sum(float(p.sum()) for p in fresh.parameters())
                reload.append(ms(start))
                del fresh
            engine.shutdown()
        p, i, r = (statistics.median(x) for x in (pub, inplace, reload))
        print(f"{shape:>5} {params / 1e6:>7.1f}M {p:>11.0f} {i:>17.0f} {r:>10.0f} {r / i:>15.2f}x")


if __name__ == "__main__":
    main()
