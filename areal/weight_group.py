"""A weight-update group: the trainer (rank 0) broadcasts tensors to inference servers.

    trainer rank 0 (master of the store at master_address:master_port)
        --broadcast, one tensor at a time, in the order of names--> server ranks 1..n

The group is SGLang's (`/init_weights_update_group`): a TCP rendezvous at
master_address:master_port, the store prefixed with the group's name, and a process group of
world_size ranks that is not torch's default group (a trainer's data-parallel world and a
server's tensor-parallel world live on beside it). gloo on CPUs, NCCL on GPUs. Every wait has
a deadline (timeout_s): a rank that never joins or dies mid-broadcast makes the others fail
with an error, never hang; a failed group is closed and a new one formed.

An update is SGLang's `/update_weights_from_distributed`: the names, dtypes and shapes of a
bucket, then one broadcast per tensor in that order; the receiver allocates each tensor from
its dtype and shape. dtypes are torch's names without the prefix ("bfloat16").
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

BACKENDS = ("gloo", "nccl")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (torch's names: float32, bfloat16, ...)")
    return dtype


def open_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
) -> Group:
    """Join the group as `rank` (0 hosts the store); returns when all world_size ranks have
    joined. TimeoutError-like RuntimeError (torch's DistStoreError) after timeout_s."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    # The layout SGLang's init_custom_process_group makes (the same torch helper, ranks
    # 0..world_size-1 of a group that is nobody's default), so that a trainer and a real
    # SGLang server find each other's keys.
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        dist.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return Group(name=group_name, rank=rank, world_size=world_size, pg=pg, store=store)


@dataclass
class Group:
    name: str
    rank: int
    world_size: int
    pg: dist.ProcessGroup
    store: dist.Store
    """Kept with the group: rank 0 serves it for as long as the group lives."""

    def close(self) -> None:
        """Leave and free the group (a broken one too)."""
        try:
            dist.destroy_process_group(self.pg)
        except Exception:  # a group whose peer died may refuse a clean shutdown: drop it
            pass


def _broadcast_all(pg: dist.ProcessGroup, tensors: Iterable[torch.Tensor]) -> None:
    works = []
    for t in tensors:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        works.append(pg.broadcast([t], opts))
    for w in works:
        w.wait()


def send(group: Group, tensors: list[torch.Tensor]) -> None:
    """Rank 0: broadcast tensors (contiguous, on the group's device), one at a time, in order."""
    _broadcast_all(group.pg, tensors)


def receive(
    group: Group,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Ranks > 0: the tensors rank 0 sends for (names, dtypes, shapes), by name."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
            f"{len(shapes)})"
        )
    out = {
        name: torch.empty(shape, dtype=dtype_of(dt), device=device)
        for name, dt, shape in zip(names, dtypes, shapes, strict=True)
    }
    _broadcast_all(group.pg, out.values())
    return out


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of about bucket_bytes each (a larger tensor alone); the
    parts of one delta (name:idx, name:val, name:sum) stay in one bucket."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size, last = 0, None
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        base = name.rpartition(":")[0] or name
        if bucket and size + nbytes > bucket_bytes and base != last:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
        last = base
    if bucket:
        yield bucket


def spec(bucket: list[tuple[str, torch.Tensor]]) -> dict:
    """The names, dtypes and shapes of a bucket: the body of an update request."""
    return {
        "names": [n for n, _ in bucket],
        "dtypes": [dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }


# ---- deltas: a version as what changed since the one every receiver holds ------------------
# (a bucket of them is sent with load_format "delta", sglang_api.DELTA: the embedded server's)


def checksum(t: torch.Tensor) -> torch.Tensor:
    """An integer sum of a tensor's bits ([1] int64): the same on every device and thread
    count, so that a receiver can check that a delta gave it the sender's tensor exactly."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(bits).sum(dtype=torch.int64).view(1)


def encode_delta(name: str, new: torch.Tensor, old: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """`new` as the entries that differ from `old` (what the receiver holds): name:idx (flat
    positions), name:val (their values), name:sum (checksum of new); `new` whole when that
    is smaller; nothing when nothing changed."""
    changed = (new != old).view(-1).nonzero().view(-1)
    if changed.numel() == 0:
        return []
    idx = changed.to(torch.int32 if new.numel() < 2**31 else torch.int64)
    delta_bytes = changed.numel() * (idx.element_size() + new.element_size()) + 8
    if delta_bytes >= new.numel() * new.element_size():
        return [(name, new)]
    return [
        (f"{name}:idx", idx),
        (f"{name}:val", new.reshape(-1)[changed]),
        (f"{name}:sum", checksum(new)),
    ]


def decode_delta(
    state: dict[str, torch.Tensor], received: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The whole tensors a bucket of deltas gives, applied to `state` (the receiver's
    weights, unchanged); ValueError when a part is missing or a checksum differs (the
    receiver did not hold the version the delta is from)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in received.items():
        name, sep, part = key.rpartition(":")
        if not sep:
            out[key] = t
            continue
        if part not in ("idx", "val", "sum"):
            raise ValueError(f"{key}: a delta's parts are name:idx, name:val and name:sum")
        if part != "idx":
            continue
        if name not in state:
            raise ValueError(f"unexpected tensor {name} (not in the model's state_dict)")
        try:
            val, want = received[f"{name}:val"], received[f"{name}:sum"]
        except KeyError as e:
            raise ValueError(f"the delta of {name} lacks its part {e.args[0]}") from e
        new = state[name].detach().clone()  # on the receiver's device; the parts may not be
        new.view(-1)[t.to(new.device, torch.long)] = val.to(new.device, new.dtype)
        if not torch.equal(checksum(new).cpu(), want.cpu()):
            raise ValueError(
                f"the delta of {name} does not give the sender's tensor (checksum): this "
                "server did not hold the version the delta is from; send it whole"
            )
        out[name] = new
    return out
