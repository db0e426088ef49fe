"""A new version from the trainer to every server: through disk against by broadcast.

    python benchmarks/weight_update.py [--shapes 0.5b,1.5b] [--servers 2] [--repeats 3]
        [--dtype bfloat16] [--dir /tmp] [--modes disk,broadcast,shared,delta] [--lora-rank 16]

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
- shared (weights.shared_memory, a run's default where every server is on the trainer's
  node): the same group's handshakes, each bucket's bytes through one file in /dev/shm that
  this process writes and every server maps (weight_group's backend "shm");
- delta (weights.delta): as broadcast, but only the entries that changed since the version the
  servers hold (positions as gaps of a byte, values and a checksum per tensor;
  areal/weight_group.py).
With --lora-rank R (model.lora), after those: an adapter of rank R on every linear layer of
the decoder (float32 A and B, as trained; every entry moves each step), handed off two ways:
- lora_disk: the adapter directory (PEFT's two files) written and loaded by every server,
  which merges it into its base;
- lora_broadcast (model.lora with weights.transport=distributed): the adapter's tensors over
  the group (load_format "lora", a layer's A and B in one bucket), merged the same way.
(One untimed adapter first: a server copies the weights adapters change at its first one.)
Timed from "the trainer holds vN" to "every server answers a generate with vN" (one token,
its weight_version checked). Also: the trainer's blocked time (disk: the write; broadcast:
the sends; delta: encoding and sends) and the bytes moved (disk: written once + read by
each server; broadcast, shared: sent to each server). Medians in seconds; the ratios disk /
broadcast, disk / shared and delta bytes / full bytes last.
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
from areal.lora import (
    LoRASpec,
    adapter_leaves,
    layer_of,
    merged_cost,
    peft_config,
    write_adapter,
)
from areal.rollout.client import SGLangClient
from areal.rollout.launch import start_embedded_server, wait_for_server
from areal.rollout.sglang_api import DELTA, LORA
from areal.weights import publish, write_tensors

QWEN2_0P5B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip
MODES = ("disk", "broadcast", "shared", "delta", "lora_disk", "lora_broadcast")
LORA_ALPHA = 32.0
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
    group,
    tensors: dict,
    clients,
    version: int,
    bucket_bytes: int,
    held: dict | None = None,
    lora: dict | None = None,
) -> tuple:
    """Whole tensors, or with `held` (what the servers hold) deltas against it, or with
    `lora` (lora_config) an adapter's tensors."""
    t0 = time.perf_counter()
    named = sorted(tensors.items()) if lora else list(tensors.items())
    if held is not None:
        named = [e for n, t in named for e in weight_group.encode_delta(n, t, held[n])]
    blocked = time.perf_counter() - t0
    load_format = LORA if lora else None if held is None else DELTA
    extra = {"lora_config": lora} if lora else {}
    # A layer's A and B in one bucket, which counts the bf16 weights it changes (as a run's).
    how = (layer_of, merged_cost(named, torch.bfloat16.itemsize)) if lora else ()
    for bucket in weight_group.buckets(named, bucket_bytes, *how):
        spec = weight_group.spec(bucket)
        posts = [
            c.update_weights_from_distributed(
                **spec,
                group_name=group.name,
                weight_version=version,
                load_format=load_format,
                **extra,
            )  # fmt: skip
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


async def by_lora_disk(root: Path, adapter: dict, lora: dict, clients, version: int) -> tuple:
    """The adapter directory written (atomically, as a version), then loaded by every server."""
    t0 = time.perf_counter()
    config = peft_config(LoRASpec(lora["r"], lora["lora_alpha"]), lora["target_modules"])
    write = functools.partial(write_adapter, tensors=adapter, config=config)
    path = await asyncio.to_thread(publish, root, version, write)
    blocked = time.perf_counter() - t0
    await asyncio.gather(*(c.update_weights_from_disk(str(path), version) for c in clients))
    await check_serving(clients, version)
    total = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in path.iterdir()) * (1 + len(clients))
    shutil.rmtree(path)
    return total, blocked, nbytes


def make_adapter(tensors: dict, rank: int, gen: torch.Generator) -> tuple[dict, dict]:
    """An adapter of `rank` on every linear layer of the decoder (PEFT's names, float32),
    and its lora_config."""
    adapter = {}
    for name, w in sorted(tensors.items()):
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            layer = f"base_model.model.{name.removesuffix('.weight')}"
            adapter[f"{layer}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=gen) / 64
            adapter[f"{layer}.lora_B.weight"] = torch.zeros(w.shape[0], rank)
    leaves = adapter_leaves(adapter)
    return adapter, {"r": rank, "lora_alpha": LORA_ALPHA, "target_modules": leaves}


def adapter_step(adapter: dict, lr: float, gen: torch.Generator) -> None:
    """One optimizer step on a float32 adapter: every entry moves (about lr each)."""
    for t in adapter.values():
        t.add_(torch.randn(t.shape, generator=gen), alpha=lr)


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


async def start_servers(root: Path, model_dir: Path, args) -> tuple[list, list]:
    procs, clients = [], []
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
    return procs, clients


async def form_group(clients: list, n: int, backend: str):
    """The trainer (this process, rank 0) and the servers in one group (gloo or shm)."""
    name, port = f"bench-{backend}", free_port("127.0.0.1")
    joining = [
        c.init_weights_update_group("127.0.0.1", port, k + 1, n + 1, name, backend)
        for k, c in enumerate(clients)
    ]
    opening = asyncio.to_thread(
        weight_group.open_group, backend=backend, master_address="127.0.0.1",
        master_port=port, rank=0, world_size=n + 1, group_name=name, timeout_s=600,
    )  # fmt: skip
    group, *_ = await asyncio.gather(opening, *joining)
    return group


async def timed_rows(root: Path, model_dir: Path, tensors: dict, clients, groups, args) -> dict:
    """Each mode's (total s, blocked s, bytes) per repeat: the full-weight modes interleaved,
    then the LoRA ones (a whole version replaces a server's LoRA base: interleaved, each
    adapter would copy it again)."""
    modes = args.modes.split(",")
    rows = {m: [] for m in MODES if m in modes}
    version, gen, bucket = 0, torch.Generator().manual_seed(0), int(args.bucket_mb * 2**20)
    adapter, lora = make_adapter(tensors, args.lora_rank, gen) if args.lora_rank else ({}, {})
    for phase in ([m for m in rows if not m.startswith("lora")],
                  [m for m in rows if m.startswith("lora")]):  # fmt: skip
        if phase and phase[0].startswith("lora"):  # untimed: the servers copy their base
            version += 1
            await by_broadcast(groups["gloo"], adapter, clients, version, bucket, lora=lora)
        for _ in range(args.repeats if phase else 0):
            for mode in phase:
                version += 1
                held = {n: t.clone() for n, t in tensors.items()} if mode == "delta" else None
                if mode.startswith("lora"):
                    adapter_step(adapter, args.lr, gen)
                else:
                    rl_step(tensors, args.lr, gen)
                if mode == "disk":
                    row = await by_disk(root, model_dir, tensors, clients, version)
                elif mode == "lora_disk":
                    row = await by_lora_disk(root, adapter, lora, clients, version)
                elif mode == "lora_broadcast":
                    row = await by_broadcast(groups["gloo"], adapter, clients, version, bucket,
                                             lora=lora)  # fmt: skip
                elif mode == "shared":
                    row = await by_broadcast(groups["shm"], tensors, clients, version, bucket)
                else:
                    row = await by_broadcast(groups["gloo"], tensors, clients, version, bucket,
                                             held)  # fmt: skip
                rows[mode].append(row)
                del held
    return rows


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
            procs, clients = await start_servers(root, model_dir, args)
            groups = {b: await form_group(clients, args.servers, b) for b in ("gloo", "shm")}
            rows = await timed_rows(root, model_dir, tensors, clients, groups, args)
            for group in groups.values():
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
    parser.add_argument("--modes", default=",".join(MODES[:4]), help=f"of {', '.join(MODES)}")
    parser.add_argument("--lora-rank", type=int, default=0, help="the adapter of the lora modes")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose of {', '.join(MODES)}")
    if any(m.startswith("lora") for m in modes) != (args.lora_rank > 0):
        parser.error("the lora modes need --lora-rank R > 0, and --lora-rank needs a lora mode")
    torch.set_num_threads(1)
    print(f"CPU, {args.dtype}, {args.servers} embedded servers, versions under "
          f"{args.dir or tempfile.gettempdir()}, steps of lr {args.lr:g}; medians of "
          f"{args.repeats}" + (f"; LoRA rank {args.lora_rank}" * bool(args.lora_rank)))  # fmt: skip
    shown = [m for m in MODES if m in modes]
    cols = " ".join(f"{c:>7}" for c in ("s", "blocked", "GB"))
    print(f"{'':>14} | " + " | ".join(f"{m:^23}" for m in shown) + " |")
    print(f"{'shape':>5} {'params':>8} | " + " | ".join(cols for _ in shown) + " | ratios")
    for shape in args.shapes.split(","):
        r = asyncio.run(run_shape(shape, args))
        cells = " | ".join(
            f"{x[0]:>7.2f} {x[1]:>7.2f} {x[2] / 1e9:>7.4f}" for x in (r[m] for m in shown)
        )
        print(f"{shape:>5} {r['params'] / 1e6:>7.0f}M | {cells} | {ratios(r, args)}")


def ratios(r: dict, args) -> str:
    """disk / broadcast time, delta / full bytes, adapter / full bytes (the full version's
    bytes to every server: params x the dtype's size x servers)."""
    out = []
    if "disk" in r and "broadcast" in r:
        out.append(f"disk/bcast {r['disk'][0] / r['broadcast'][0]:.2f}x")
    if "disk" in r and "shared" in r:
        out.append(f"disk/shared {r['disk'][0] / r['shared'][0]:.2f}x")
    if "delta" in r and "broadcast" in r:
        out.append(f"delta/full bytes {r['delta'][2] / r['broadcast'][2]:.3f}")
    if "lora_broadcast" in r:
        full = r["params"] * getattr(torch, args.dtype).itemsize * args.servers
        out.append(f"adapter/full bytes {r['lora_broadcast'][2] / full:.4f}")
    if "lora_disk" in r and "lora_broadcast" in r:
        out.append(f"lora disk/bcast {r['lora_disk'][0] / r['lora_broadcast'][0]:.2f}x")
    return ", ".join(out)


if __name__ == "__main__":
    main()
