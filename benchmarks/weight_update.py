"""A new version from the trainer to every server: through disk against by broadcast.

    python benchmarks/weight_update.py [--shapes 0.5b,1.5b] [--servers 2] [--repeats 3]
        [--dtype bfloat16] [--dir /tmp]

Real embedded server processes (--servers of them) hold a random Qwen2 of the shape; this
process stands in for trainer rank 0 and holds the same weights. Each repeat changes every
weight (a new version) and hands it off both ways, interleaved:
- disk (weights.transport=disk, the paper's): areal.weights.publish writes weights/vN/
  (safetensors + config + tokenizer, atomic rename), then every server loads it at once
  (/update_weights_from_disk, concurrently);
- broadcast (weights.transport=distributed): the trainer and the servers in one gloo
  weight-update group (formed once, before the timing: a run forms it at its first
  update); per bucket of --bucket-mb, every server's /update_weights_from_distributed
  concurrently with the trainer's broadcast.
Timed from "the trainer holds vN" to "every server answers a generate with vN" (one token,
its weight_version checked). Also: the trainer's blocked time (disk: the write; broadcast:
the sends) and the bytes moved (disk: written once + read by each server; broadcast: sent
to each server). Medians in seconds; the ratio disk / broadcast last.

Deltas (weights.delta) are not built: only full versions.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from shapes import QWEN2_1P5B, save_random_qwen2

from areal import weight_group
from areal.comm.net import free_port
from areal.rollout.client import SGLangClient
from areal.rollout.launch import start_embedded_server, wait_for_server
from areal.weights import copy_companion_files, publish

QWEN2_0P5B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip
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

    def write(out: Path) -> None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy2(model_dir / "config.json", out / "config.json")
        copy_companion_files(model_dir, out)

    path = await asyncio.to_thread(publish, root, version, write)
    blocked = time.perf_counter() - t0
    await asyncio.gather(*(c.update_weights_from_disk(str(path), version) for c in clients))
    await check_serving(clients, version)
    total = time.perf_counter() - t0
    nbytes = (path / "model.safetensors").stat().st_size * (1 + len(clients))
    shutil.rmtree(path)
    return total, blocked, nbytes


async def by_broadcast(group, tensors: dict, clients, version: int, bucket_bytes: int) -> tuple:
    t0 = time.perf_counter()
    blocked = 0.0
    for bucket in weight_group.buckets(tensors.items(), bucket_bytes):
        spec = weight_group.spec(bucket)
        posts = [
            c.update_weights_from_distributed(**spec, group_name=group.name, weight_version=version)
            for c in clients
        ]
        t_send = time.perf_counter()
        sending = asyncio.to_thread(weight_group.send, group, [t for _, t in bucket])
        await asyncio.gather(sending, *posts)
        blocked += time.perf_counter() - t_send
    await check_serving(clients, version)
    total = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values()) * len(clients)
    return total, blocked, nbytes


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
            rows = {"disk": [], "broadcast": []}
            version = 0
            for _ in range(args.repeats):
                for mode in ("disk", "broadcast"):
                    version += 1
                    for t in tensors.values():  # a new version: every weight changes
                        t.add_(1e-3)
                    if mode == "disk":
                        rows[mode].append(await by_disk(root, model_dir, tensors, clients, version))
                    else:
                        rows[mode].append(
                            await by_broadcast(
                                group, tensors, clients, version, int(args.bucket_mb * 2**20)
                            )
                        )
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
    parser.add_argument("--dir", default=None, help="where weights/vN is written (run storage)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU, {args.dtype}, {args.servers} embedded servers, versions under "
          f"{args.dir or tempfile.gettempdir()}; medians of {args.repeats}")  # fmt: skip
    print(f"{'shape':>5} {'params':>8} | {'disk s':>7} {'blocked':>8} {'GB':>6} | "
          f"{'bcast s':>7} {'blocked':>8} {'GB':>6} | {'disk/bcast':>10}")  # fmt: skip
    for shape in args.shapes.split(","):
        r = asyncio.run(run_shape(shape, args))
        d, b = r["disk"], r["broadcast"]
        print(f"{shape:>5} {r['params'] / 1e6:>7.0f}M | {d[0]:>7.2f} {d[1]:>8.2f} "
              f"{d[2] / 1e9:>6.2f} | {b[0]:>7.2f} {b[1]:>8.2f} {b[2] / 1e9:>6.2f} | "
              f"{d[0] / b[0]:>9.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
