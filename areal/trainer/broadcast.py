"""weights.transport=distributed, the trainer's side: each version broadcast to the servers.

    global rank 0, version v:
      the HF tensors (backend.hf_tensors, in the servers' dtype), in buckets of bucket_mb
      every disk_every-th version: a copy to weights/vN/, written in the background
      controller.weights_ready(v, newest on disk, broadcast={buckets' specs, address})
          <-- the group: name, world size, new?   (once the previous update is done)
      new group: leave the old one, host the new one's store and join it as rank 0
      per bucket: broadcast its tensors         (each server's rollout worker posts the
                                                 bucket's /update_weights_from_distributed)

The trainer waits for the broadcast (that is the hand-off's cost on its critical path) but
not for the disk copy. A broadcast that fails (a server died, a deadline passed) is logged
and the group dropped: the servers that missed it load the newest version on disk, and the
next version is sent in a new group. Disk stays the source of truth for recovery: a server
that restarts loads the newest version there, then joins at the next broadcast.

gloo unless the servers are SGLang's (NCCL between GPUs); the group's device follows. Where
every server listens on this node (weights.shared_memory), gloo carries only the handshakes
and the bytes go through /dev/shm (weight_group's "shm"): decided for each new group, and
dropped for the run if a server cannot map the files (another node after all).

model.lora: a version is the adapter alone (backend.hf_tensors: PEFT's names, float32 as
trained and as the adapter directory holds them), each layer's A and B in one bucket, sent
with load_format "lora" and lora_config (r, lora_alpha, target_modules): the embedded
server merges them into its base as it merges an adapter directory (the same bits). Its
disk copies are adapter directories (PEFT's format), as with weights.transport=disk.
"""

from __future__ import annotations

import functools
import logging
import shutil
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import torch

from areal import weight_group
from areal.comm.net import advertised_host, free_port
from areal.comm.registry import Registry
from areal.comm.rpc import SyncRpcClient
from areal.config import ExperimentConfig
from areal.lora import adapter_leaves, layer_of, merged_cost, peft_config, write_adapter
from areal.rollout.backends import load_backend
from areal.rollout.sglang_api import DELTA, LORA
from areal.trainer.backends.torch import lora_spec
from areal.weights import publish, version_dir, write_tensors

log = logging.getLogger("areal.trainer")


class WeightBroadcaster:
    """Global rank 0's hand-off of each version by broadcast (and every few, to disk)."""

    def __init__(self, cfg: ExperimentConfig, model_dir: str | Path, version: int):
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.dtype = getattr(torch, cfg.model.dtype)
        self.bucket_bytes = int(cfg.weights.bucket_mb * 2**20)
        self.backend = load_backend(cfg.inference.backend).group_backend
        self.device = "cuda" if self.backend == "nccl" else "cpu"
        self.shared_memory = self.backend == "gloo" and cfg.weights.shared_memory
        """The bytes through /dev/shm where every server is on this node (see _group_backend)."""
        self.host = advertised_host()
        self.group: weight_group.Group | None = None
        self.on_disk: tuple[int, str] = (version, str(model_dir))
        """The newest version complete on disk: what a server falls back to."""
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="weights-to-disk")
        self._writing: Future | None = None
        self._held: dict[str, torch.Tensor] | None = None
        """weights.delta: the version every server of the group holds (the last one sent)."""
        self.stats: dict[str, float] = {}
        """The last version's hand-off, for the metrics line."""
        self.lora = lora_spec(cfg)
        """model.lora: versions are adapters (sent as trained: float32)."""

    def _prepared(self, named: Iterable[tuple[str, torch.Tensor]]) -> list:
        """The tensors to send, on the group's device: in the servers' dtype, or an
        adapter's as trained (the dtype its directory holds: the same bits either way)."""
        dtype = torch.float32 if self.lora else self.dtype
        return [(n, t.detach().to(self.device, dtype).contiguous()) for n, t in named]

    def _lora_bucketing(self, named: list[tuple[str, torch.Tensor]]) -> tuple:
        """buckets()' unit and cost with model.lora (areal/lora.py's merged_cost: a bucket
        counts the server's weights it changes, which the server holds merged)."""
        return () if self.lora is None else (layer_of, merged_cost(named, self.dtype.itemsize))

    def _lora_config(self, named: list[tuple[str, torch.Tensor]]) -> dict | None:
        """model.lora: how a server applies the adapter (PEFT's fields, on the wire)."""
        if self.lora is None:
            return None
        leaves = adapter_leaves(n for n, _ in named)
        return {"r": self.lora.rank, "lora_alpha": self.lora.alpha, "target_modules": leaves}

    def publish(
        self,
        controller: SyncRpcClient,
        version: int,
        named: Iterable[tuple[str, torch.Tensor]],
    ) -> None:
        named = self._prepared(named)
        on_disk = version % self.cfg.weights.disk_every == 0
        if on_disk:
            self._to_disk(version, named)
        full = list(weight_group.buckets(named, self.bucket_bytes, *self._lora_bucketing(named)))
        delta = self._delta(named)
        group = self._announce(controller, version, named, full, delta, on_disk)
        sent = delta if group["delta"] else full
        self._held = None  # until every server holds this version
        if not self._send(group, sent, version, named, on_disk):
            return
        if self.cfg.weights.delta:
            self._held = {n: t.clone() for n, t in named}
        servers = group["world_size"] - 1
        self.stats = {
            "weights/sent_bytes": float(_nbytes(sent) * servers),
            "weights/full_bytes": float(_nbytes(full) * servers),
        }

    def _announce(
        self,
        controller: SyncRpcClient,
        version: int,
        named: list[tuple[str, torch.Tensor]],
        full: list,
        delta: list | None,
        on_disk: bool,
    ) -> dict:
        """weights_ready to the controller, with the buckets' specs and where to meet; its
        answer: the group (name, world size, new?, delta accepted?), once the previous
        update is done. A group of the other backend is left first."""
        path = str(version_dir(self.cfg.exp_dir, version))  # where a server may read it
        backend = self._group_backend(_nbytes([named]))
        if self.group is not None and self.group.backend != backend:
            self.close_group()  # a new group with the other backend
        return controller.call(
            "weights_ready",
            version=version,
            path=path if on_disk else self.on_disk[1],
            disk_version=version if on_disk else self.on_disk[0],
            broadcast={
                "path": path,
                "buckets": [weight_group.spec(b) for b in full],
                "delta": None
                if delta is None  # an empty delta (nothing changed) is one to send
                else {"buckets": [weight_group.spec(b) for b in delta], "load_format": DELTA},
                "load_format": LORA if self.lora else None,
                "lora_config": self._lora_config(named),
                "master_address": self.host,
                "master_port": free_port(),
                "backend": backend,
                "timeout_s": self.cfg.weights.timeout_s,
                "new_group": self.group is None,
            },
        )

    def _send(
        self,
        group: dict,
        sent: list,
        version: int,
        named: list[tuple[str, torch.Tensor]],
        on_disk: bool,
    ) -> bool:
        """Broadcast the buckets `sent` over the group (joined first if new); False when
        no server serves or the broadcast failed (the group dropped, the version written
        to disk for the servers that missed it)."""
        try:
            if group["new"] or group["world_size"] == 1:
                self.close_group()
            if group["world_size"] == 1:
                return False  # no server serves: each loads the newest on disk once back
            if self.group is None:
                self.group = weight_group.open_group(
                    backend=group["backend"],
                    master_address=self.host,
                    master_port=group["master_port"],
                    rank=0,
                    world_size=group["world_size"],
                    group_name=group["group_name"],
                    timeout_s=self.cfg.weights.timeout_s,
                )
            for bucket in sent:
                weight_group.send(self.group, [t for _, t in bucket])
        except Exception as e:  # noqa: BLE001 (any failure of the group: drop it, go on)
            if isinstance(e, weight_group.NotShared):
                self.shared_memory = False
            log.warning(
                "broadcasting version %d failed (%s: %s): the servers that missed it load it "
                "from disk; the next version goes to a new group",
                version, type(e).__name__, e,
            )  # fmt: skip
            self.close_group()
            if not on_disk:  # the servers that missed it read it there
                self._to_disk(version, named)
            return False
        return True

    def _group_backend(self, version_bytes: int) -> str:
        """shm when every registered server listens on this node's address and /dev/shm has
        room for a version (a vLLM server holds every bucket of one until the last), else
        the socket's backend."""
        if not self.shared_memory:
            return self.backend
        registry = Registry(self.cfg.exp_dir)
        hosts = set()
        for k in range(self.cfg.rollout.n_servers):
            try:
                hosts.add(urlsplit(registry.path("server", k).read_text()).hostname)
            except OSError:  # not up: decided again for the group it joins
                continue
        try:
            room = shutil.disk_usage(weight_group.SHM_DIR).free
        except OSError:
            return self.backend
        here = hosts <= {self.host}
        return "shm" if here and room > version_bytes + self.bucket_bytes else self.backend

    def _delta(self, named: list[tuple[str, torch.Tensor]]) -> list | None:
        """The buckets of what changed since the version the group holds (weights.delta),
        if it may be sent: the group goes on and received that version."""
        if self._held is None or self.group is None:
            return None
        entries = [e for n, t in named for e in weight_group.encode_delta(n, t, self._held[n])]
        return list(weight_group.buckets(entries, self.bucket_bytes))

    def _to_disk(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """weights/v{version}/ from a copy of the tensors (the training goes on meanwhile),
        written after the previous one; on_disk moves once it is complete."""
        copy = {n: t.to("cpu", copy=True) for n, t in named}
        self.wait_for_disk()

        if self.lora:  # an adapter directory, as save_hf writes it
            config = peft_config(self.lora, adapter_leaves(copy), str(self.cfg.model.path))
            write = functools.partial(write_adapter, tensors=copy, config=config)
        else:
            write = functools.partial(write_tensors, tensors=copy, model_dir=self.model_dir)

        def job() -> None:
            self.on_disk = (version, str(publish(self.cfg.exp_dir, version, write)))

        self._writing = self._writer.submit(job)

    def wait_for_disk(self) -> None:
        """Until the background copy to disk (if any) is complete; its error, if it failed."""
        if self._writing is not None:
            self._writing.result()

    def close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def close(self) -> None:
        self.wait_for_disk()
        self._writer.shutdown()
        self.close_group()


def _nbytes(buckets: list[list[tuple[str, torch.Tensor]]]) -> int:
    return sum(t.numel() * t.element_size() for b in buckets for _, t in b)
