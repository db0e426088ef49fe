"""Trainer model-FLOPs utilisation: the megatron backend against the torch backend.

    python benchmarks/megatron_mfu.py [--tokens 8192] [--seq-len 1024] [--repeats 3]

One PPO-style update (packed forward, log-probs, backward, optimizer step) of a Qwen2 model
with random weights, the same packed sequences for both backends, in this one process:

- GPU: the DeepSeek-R1-Distill-Qwen-1.5B shape in bf16 (megatron: bf16 params, fp32 grads
  and Adam states; torch: bf16 transformers model, AdamW); MFU against the card's dense
  bf16 peak (--peak-tflops, or a table of known cards).
- CPU: a tiny shape in fp32, said so on the first line; MFU is printed against
  --peak-tflops only if given (there is no meaningful CPU peak to assume).

Model FLOPs per token = 6 * parameters (the input embedding's aside: a lookup) + 12 *
layers * hidden * seq_len / 2 (causal attention; no recomputation counted). Medians of the
repeats; each backend alone on the device in turn (both together with a long update's
activations do not fit even 141 GB).
The last lines are the ratios of tokens per second megatron / torch and megatron / megatron
without its fused kernels (megatron-unfused), for the backends run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
import warnings

import torch
from shapes import QWEN2_1P5B, save_random_qwen2
from transformers import Qwen2Config, Qwen2ForCausalLM

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


TINY = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    tie_word_embeddings=True,
)  # fmt: skip


def peak_tflops(arg: float | None) -> float | None:
    if arg or not torch.cuda.is_available():
        return arg
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def one_update(backend, seqs) -> float:
    """Seconds of forward + log-probs + backward + reduction + optimizer step."""
    from areal.trainer.parallel import DataParallel

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    lp = backend.logprobs(seqs)
    (-lp.float().mean()).backward()
    backend.reduce_grads(DataParallel())
    backend.optimizer_step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def print_profile(name: str, backend, seqs, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        one_update(backend, seqs)
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    print(f"{name}: one update, the {rows} costliest operators")
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=100))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per update")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument(
        "--backends", default="torch,megatron",
        help="comma-separated, run in the order given (torch before the megatron ones: "
        "megatron's parallel state outlives its backend): torch, megatron, megatron-unfused "
        "(the megatron backend without its fused kernels, megatron.model.transformer_config)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="after timing, profile one more update of each backend and print its N "
        "costliest operators (device time)",
    )  # fmt: skip
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    on_gpu = torch.cuda.is_available()
    seq_len = args.seq_len or (1024 if on_gpu else 128)
    n_tokens = args.tokens or (8192 if on_gpu else 512)
    dtype = "bfloat16" if on_gpu else "float32"
    cfg = Qwen2Config(**(QWEN2_1P5B if on_gpu else TINY))
    where = torch.cuda.get_device_name() if on_gpu else "CPU (tiny shape, not the 1.5B one)"
    print(f"device: {where}; {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {dtype}")
    from areal.trainer.megatron.backend import MegatronBackend
    from areal.trainer.optimizer import OptimizerSpec
    from areal.trainer.torch_backend import TorchBackend

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    seqs = [
        torch.randint(0, cfg.vocab_size, (seq_len,), generator=g).tolist()
        for _ in range(n_tokens // seq_len)
    ]
    opt = OptimizerSpec(
        lr=1e-6, weight_decay=0.0, betas=(0.9, 0.95), adam_eps=1e-8, grad_clip=1.0, warmup_steps=0
    )
    with tempfile.TemporaryDirectory() as d:
        save_random_qwen2(d, QWEN2_1P5B if on_gpu else TINY, getattr(torch, dtype))
        # The input embedding is a lookup, not arithmetic (tied, it is also the output layer).
        with torch.device("meta"):
            n_params = sum(p.numel() for p in Qwen2ForCausalLM(cfg).parameters())
        if not cfg.tie_word_embeddings:
            n_params -= cfg.vocab_size * cfg.hidden_size
        makers = {  # torch first: megatron's parallel state outlives its backend
            "torch": lambda: TorchBackend.from_dir(d, optimizer=opt, dtype=dtype),
            "megatron-unfused": lambda: MegatronBackend(d, optimizer=opt, dtype=dtype, fused=False),
            "megatron": lambda: MegatronBackend(d, optimizer=opt, dtype=dtype),
        }
        flops_per_token = 6 * n_params + 6 * cfg.num_hidden_layers * cfg.hidden_size * seq_len
        peak = peak_tflops(args.peak_tflops)
        # One backend on the GPU at a time: two 1.5B models with Adam states and a long
        # update's activations together do not fit even 141 GB.
        rate: dict[str, float] = {}
        for k in args.backends.split(","):
            backend = makers[k]()
            try:
                one_update(backend, seqs)  # warm-up: kernels, compiling, optimizer states
                times = [one_update(backend, seqs) for _ in range(args.repeats)]
                rate[k] = n_tokens / statistics.median(times)
                tflops = rate[k] * flops_per_token / 1e12
                mfu = f"MFU {100 * tflops / peak:5.1f}% of {peak:.0f} TFLOP/s" if peak else ""
                print(f"{k:16s} {rate[k]:10.1f} tokens/s  {tflops:8.3f} TFLOP/s  {mfu}")
                if args.profile:
                    print_profile(k, backend, seqs, args.profile)
            except torch.OutOfMemoryError:
                print(f"{k}: out of GPU memory at {n_tokens} tokens an update")
            del backend
            gc.collect()
            if on_gpu:
                peak_gb = torch.cuda.max_memory_allocated() / 2**30
                print(f"{k}: peak GPU memory {peak_gb:.1f} GiB", flush=True)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    for a, b in (("megatron", "torch"), ("megatron", "megatron-unfused")):
        if a in rate and b in rate:
            print(f"{a} / {b}: {rate[a] / rate[b]:.2f}x")


if __name__ == "__main__":
    main()
