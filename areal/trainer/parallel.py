"""Data parallelism of the trainer: one torch.distributed world of trainer ranks.

    controller --get_batch--> rank 0 --broadcast(msgpack bytes)--> ranks 1..world-1
    every rank: its share of each minibatch -> micro-batches -> backward
             -> all_reduce(grads, sum) -> clip -> optimizer step   (weights stay identical)
    rank 0 alone: weights_ready, metrics.jsonl, weights/vN, checkpoints

| waits for                          | unblocked by                                    |
|------------------------------------|-------------------------------------------------|
| broadcast of the batch (ranks > 0) | rank 0 getting the batch from the controller    |
| every all_reduce                   | every rank reaching the same collective         |

Launch contract (the local and SLURM launchers): each rank is
`python -m areal.worker --role trainer --index RANK --exp-dir DIR` with the standard
`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (and `LOCAL_RANK`) variables. With
WORLD_SIZE unset or 1 there is no process group and every collective here is a no-op.
With the megatron backend the world is tp * pp * dp ranks: the batch broadcast and the
barrier span it, the reductions (gradients, counts, statistics) only the data-parallel group.

Nothing is pickled between ranks: the batch travels as the wire format's msgpack bytes
in a uint8 tensor, and statistics as float64 tensors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from areal.comm import wire


class DataParallel:
    """This rank's place in the trainer world, and the few collectives the trainer needs."""

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        global_rank: int | None = None,
        global_size: int | None = None,
        model_parallel: dist.ProcessGroup | None = None,
    ):
        """rank/world_size: this rank among the data-parallel replicas, whose `group` (None:
        the whole world) the reductions run over. With tensor or pipeline parallelism the
        world is larger (global_size = tp * pp * dp) and the batch broadcast reaches all of it;
        model_parallel is the group of this rank's replica (its tp * pp ranks).
        """
        assert 0 <= rank < world_size
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.model_parallel = (
            model_parallel if model_parallel and model_parallel.size() > 1 else None
        )
        self.global_rank = rank if global_rank is None else global_rank
        self.global_size = world_size if global_size is None else global_size
        # NCCL reduces CUDA tensors only; gloo CPU tensors.
        self.device = device or torch.device("cpu")

    def replicas(
        self,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        model_parallel: dist.ProcessGroup | None = None,
    ) -> DataParallel:
        """The same world with reductions over the data-parallel group `group` only; this
        rank's replica is the group model_parallel."""
        return DataParallel(
            rank,
            world_size,
            self.device,
            group=group,
            global_rank=self.global_rank,
            global_size=self.global_size,
            model_parallel=model_parallel,
        )

    @property
    def replica_head(self) -> bool:
        """The first rank of this rank's replica (every rank without model parallelism)."""
        mp = self.model_parallel
        return mp is None or dist.get_process_group_ranks(mp)[0] == self.global_rank

    def from_replica_head(self, obj: Any = None) -> Any:
        """The replica head's plain-data object on every rank of its replica (tp * pp ranks),
        sent within that group only."""
        mp = self.model_parallel
        if mp is None:
            return obj
        return broadcast_plain(obj, dist.get_process_group_ranks(mp)[0], mp, self.device)

    @property
    def is_main(self) -> bool:
        """Global rank 0: talks to the controller, writes metrics and weights."""
        return self.global_rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    # ---- collectives: no-ops in a world of one -------------------------------------------

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Element-wise sum (or max) of a list of numbers over all ranks."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(
            t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group
        )
        return t.tolist()

    def all_gather(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D tensor (lengths may differ), concatenated in rank order, as
        float64 on the CPU."""
        values = values.to(torch.float64).flatten()
        if not self.enabled:
            return values.cpu()
        n = torch.tensor([len(values)], device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=self.group)
        padded = torch.zeros(int(max(sizes)), dtype=torch.float64, device=self.device)
        padded[: len(values)] = values.to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[: int(k)] for p, k in zip(parts, sizes, strict=True)]).cpu()

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every gradient over the ranks, in one flat buffer (one collective per step).

        The loss is already divided by the valid tokens of the whole minibatch on all
        ranks, so the sum is the gradient of the whole minibatch. A rank that ran nothing
        contributes zeros.
        """
        if not self.enabled:
            return
        params = [p for p in params if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        for p, part in zip(params, flat.split([g.numel() for g in grads]), strict=True):
            p.grad = part.view_as(p).clone()

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's plain-data object (msgpack-able) on every rank of the trainer world."""
        if self.global_size == 1:
            return obj
        return broadcast_plain(obj, src=0, device=self.device)

    # ---- splitting the work --------------------------------------------------------------

    def share(self, indices: Sequence[int], seqlens: Sequence[int]) -> list[int]:
        """This rank's part of a minibatch: sequences split across ranks balancing tokens.

        Longest first, each to the rank holding the fewest tokens so far (ties: lowest
        rank). Every rank computes the same split from the same batch, so no message is
        needed; the parts are disjoint and together are the minibatch.
        """
        loads = [0] * self.world_size
        mine = []
        for i in sorted(indices, key=lambda i: (-seqlens[i], i)):
            r = min(range(self.world_size), key=lambda r: (loads[r], r))
            loads[r] += seqlens[i]
            if r == self.rank:
                mine.append(i)
        return sorted(mine)

    def reduce_stats(self, sums: Mapping[str, float]) -> dict[str, float]:
        """Sum every statistic over the ranks, except `*_max` ones which take the maximum.

        Every rank must pass the same keys (a rank that ran nothing passes zeros).
        """
        keys = sorted(sums)
        maxes = [k for k in keys if k.endswith("_max")]
        plain = [k for k in keys if not k.endswith("_max")]
        out = dict(zip(plain, self.all_reduce([sums[k] for k in plain], "sum"), strict=True))
        out.update(zip(maxes, self.all_reduce([sums[k] for k in maxes], "max"), strict=True))
        return out

    def barrier(self) -> None:
        if self.global_size > 1:
            dist.barrier()

    def close(self) -> None:
        if self.global_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def broadcast_plain(
    obj: Any, src: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> Any:
    """Global rank `src`'s plain-data object (msgpack-able) on every rank of `group` (None:
    the world): its length first, then its bytes."""
    device = device or torch.device("cpu")
    is_src = dist.get_rank() == src
    if is_src:
        body = wire.pack(obj)
        size = torch.tensor([len(body)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if is_src:
        buf = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return obj if is_src else wire.unpack(buf.cpu().numpy().tobytes())


def init_data_parallel(
    dp: int, index: int, timeout_s: float, model_parallel: int = 1
) -> DataParallel:
    """Join the trainer world described by the launcher's environment variables.

    `dp` is trainer.parallel.dp, `model_parallel` tp * pp (the world is their product);
    `index` the role's --index. A mismatch between them and the environment is a launcher
    mistake, reported with what to set. Without model parallelism the world is the
    data-parallel group; with it, the backend narrows the reductions (`replicas`).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", str(index)))
    if world_size != dp * model_parallel:
        mp = f" with tp * pp = {model_parallel}" if model_parallel > 1 else ""
        raise ValueError(
            f"WORLD_SIZE={world_size} but trainer.parallel.dp={dp}{mp}: start exactly "
            "tp * pp * dp trainer ranks, each with WORLD_SIZE set to that (unset means 1)"
        )
    if rank != index:
        raise ValueError(f"RANK={rank} but --index {index}: pass the rank as --index")
    if world_size == 1:
        return DataParallel()
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise ValueError(f"{var} is not set: trainer ranks rendezvous at rank 0's address")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # The timeout bounds every collective as well as the rendezvous, so a dead peer fails
    # the others instead of hanging them; ranks > 0 also wait in it while rank 0 waits for
    # a batch, hence the generous default.
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return DataParallel(rank, world_size, device)
