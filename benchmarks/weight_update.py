"""A new version from the trainer to every server: through disk against by broadcast.

    python benchmarks/weight_update.py [--shapes 0.5b,1.5b] [--servers 2] [--repeats 3]
        [--dtype bfloat16] [--dir /tmp]

Real embedded server processes (--servers of them) hold a random Qwen2 of the shape; this
process stands in for trainer rank 0 and holds the same weights. Each repeat makes a new
version by one RL step (every weight moves by --lr, Adam-like, from an fp32 master that
sits anywhere in its bf16 rounding interval, as after many steps) and hands it off three
ways, interleaved:
- disk (weights.transport=disk, the paper's): areal.weights.publish writes weights/vN/
  (safetensors + config + tokenizer, atomic rename), then every server loads it at once
  (/update_weights_from_disk, concurrently);
- broadcast (weights.transport=distributed): the trainer and the servers in one gloo
  weight-update group (formed once, before the timing: a run forms it at its first
  update); per bucket of --bucket-mb, every server's /update_weights_from_distributed
  concurrently with the trainer's broadcast;
- delta (weights.delta): the same, but only the entries that changed since the version the
  servers hold (positions as gaps of a byte, values and a checksum per tensor;
  areal/weight_group.py).
Timed from "the trainer holds vN" to "every server answers a generate with vN" (one token,
its weight_version checked). Also: the trainer's blocked time (disk: the write; broadcast:
the sends; delta: encoding and sends) and the bytes moved (disk: written once + read by
each server; broadcast: sent to each server). Medians in seconds; the ratios disk /
broadcast and delta bytes / full bytes last.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from shapes import QWEN2_1P5B, save_random_qwen2

from areal import weight_group
from areal.comm.net import free_port
from areal.rollout.client import SGLangClient
from areal.rollout.launch import start_embedded_server, wait_for_server
from areal.rollout.sglang_api import DELTA
from areal.weights import publish, write_tensors

QWEN2_0P5B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip
MODES = ("disk", "broadcast", "delta")
SHAPES = {
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "0.5b": QWEN2_0P5B,
    "1.5b": QWEN2_1P5B,
}  # fmt: skip


async def check_serving(clients: list[SGLangClient], version: int) -> None:
    """Every server answers a one-token generate with `version`'s weights."""
    outs = await asyncio.gather(
        *(c.generate_batch([[1, 2, 3]], [{"max_new_tokens": 1}], [f"check-{version}"])
          for c in clients)
    )  # fmt: skip
    got = [o[0].weight_version for o in outs]
    assert got == [version] * len(clients), got


async def by_disk(root: Path, model_dir: Path, tensors: dict, clients, version: int) -> tuple:
    t0 = time.perf_counter()

    write = functools.partial(write_tensors, tensors=tensors, model_dir=model_dir)
    path = await asyncio.to_thread(publish, root, version, write)
    blocked = time.perf_counter() - t0
    await asyncio.gather(*(c.update_weights_from_disk(str(path), version) for c in clients))
    await check_serving(clients, version)
    total = time.perf_counter() - t0
    nbytes = (path / "model.safetensors").stat().st_size * (1 + len(clients))
    shutil.rmtree(path)
    return total, blocked, nbytes


async def by_broadcast(
    group, tensors: dict, clients, version: int, bucket_bytes: int, held: dict | None = None
) -> tuple:
    """Whole tensors, or with `held` (what the servers hold) deltas against it."""
    t0 = time.perf_counter()
    named = list(tensors.items())
    if held is not None:
        named = [e for n, t in named for e in weight_group.encode_delta(n, t, held[n])]
    blocked = time.perf_counter() - t0
    load_format = None if held is None else DELTA
    for bucket in weight_group.buckets(named, bucket_bytes):
        spec = weight_group.spec(bucket)
        posts = [
            c.update_weights_from_distributed(
                **spec, group_name=group.name, weight_version=version, load_format=load_format
            )
            for c in clients
        ]
        t_send = time.perf_counter()
        sending = asyncio.to_thread(weight_group.send, group, [t for _, t in bucket])
        await asyncio.gather(sending, *posts)
        blocked += time.perf_counter() - t_send
    await check_serving(clients, version)
    total = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for _, t in named) * len(clients)
    return total, blocked, nbytes


def rl_step(tensors: dict, lr: float, gen: torch.Generator) -> None:
    """One optimizer step of size lr on every weight (Adam's steps are about lr each), from an
    fp32 master anywhere in the bf16 rounding interval of the weight: only the weights whose
    master crosses a rounding boundary change in bf16."""
    for t in tensors.values():
        for chunk in t.view(-1).split(1 << 24):  # bounded temporaries
            x = chunk.float()
            ulp = torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)
            master = x + (torch.rand(x.shape, generator=gen) - 0.5) * ulp
            step = lr * torch.sign(torch.randn(x.shape, generator=gen))
            chunk.copy_(master - step)


async def run_shape(shape: str, args) -> dict:
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        model_dir = save_random_qwen2(root / "model", SHAPES[shape], dtype)
        tensors = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            tensors.update(load_file(f))
        procs, clients = [], []
        try:
            for k in range(args.servers):
                proc, url = start_embedded_server(
                    model_dir, root / f"server{k}.log", "--dtype", args.dtype,
                    "--num-threads", "1", "--max-batch-size", "1", "--max-total-tokens", "64",
                    "--weights-root", str(root), "--weight-version", "0",
                )  # fmt: skip
                procs.append(proc)
                clients.append(SGLangClient(url))
            for c, p, k in zip(clients, procs, range(args.servers), strict=True):
                await wait_for_server(c, 600, root / f"server{k}.log", p)
            name, port = "bench", free_port("127.0.0.1")
            joining = [
                c.init_weights_update_group(
                    "127.0.0.1", port, k + 1, args.servers + 1, name, "gloo"
                )
                for k, c in enumerate(clients)
            ]
            opening = asyncio.to_thread(
                weight_group.open_group, backend="gloo", master_address="127.0.0.1",
                master_port=port, rank=0, world_size=args.servers + 1, group_name=name,
                timeout_s=600,
            )  # fmt: skip
            group, *_ = await asyncio.gather(opening, *joining)
            rows = {m: [] for m in MODES}
            version, gen, bucket = 0, torch.Generator().manual_seed(0), int(args.bucket_mb * 2**20)
            for _ in range(args.repeats):
                for mode in rows:
                    version += 1
                    held = {n: t.clone() for n, t in tensors.items()} if mode == "delta" else None
                    rl_step(tensors, args.lr, gen)
                    if mode == "disk":
                        rows[mode].append(await by_disk(root, model_dir, tensors, clients, version))
                    else:
                        rows[mode].append(
                            await by_broadcast(group, tensors, clients, version, bucket, held)
                        )
                    del held
            group.close()
        finally:
            for c in clients:
                await c.close()
            for p in procs:
                p.kill()
                p.wait()
    params = sum(t.numel() for t in tensors.values())
    med = {m: [statistics.median(x[i] for x in r) for i in range(3)] for m, r in rows.items()}
    return {"params": params, **med}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--lr", type=float, default=1e-6, help="the step of each new version")
    parser.add_argument("--dir", default=None, help="where weights/vN is written (run storage)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU, {args.dtype}, {args.servers} embedded servers, versions under "
          f"{args.dir or tempfile.gettempdir()}, steps of lr {args.lr:g}; medians of "
          f"{args.repeats}")  # fmt: skip
    cols = " ".join(f"{c:>7}" for c in ("s", "blocked", "GB"))
    print(f"{'':>14} | {'disk':^23} | {'broadcast':^23} | {'delta':^23} |")
    print(f"{'shape':>5} {'params':>8} | {cols} | {cols} | {cols} | disk/bcast delta/full")
    for shape in args.shapes.split(","):
        r = asyncio.run(run_shape(shape, args))
        cells = " | ".join(
            f"{x[0]:>7.2f} {x[1]:>7.2f} {x[2] / 1e9:>7.3f}" for x in (r[m] for m in MODES)
        )
        d, b, x = (r[m] for m in MODES)
        print(f"{shape:>5} {r['params'] / 1e6:>7.0f}M | {cells} | "
              f"{d[0] / b[0]:>9.2f}x {x[2] / b[2]:>10.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
