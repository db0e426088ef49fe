"""The rollout controller: dataset -> generate -> reward -> buffer -> trainer.

    dataset --prompt--> [staleness gate] --generate(group)--> rollout worker k
                                                                 | G trajectories
    trainer <--get_batch(i)-- [replay buffer] <--rewards-- reward service
    trainer --weights_ready(i+1)--> update every worker --> gate.on_version(i+1)

| loop            | waits for                                   | unblocked by                 |
|-----------------|---------------------------------------------|------------------------------|
| admit           | gate capacity (staleness bound, in-flight)  | a finished group, a version  |
| one group       | its worker, then the reward service         | their replies                |
| get_batch(i)    | a batch the buffer may hand out at i        | a finished group             |
| weight update   | every worker to load version i              | their replies                |

Everything runs on one asyncio loop, so the gate and the buffer need no lock: their
state changes only between awaits, and `changed` wakes whoever waits on them.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from areal.comm.registry import Registry
from areal.comm.rpc import RpcClient, RpcServer
from areal.controller.buffer import ReplayBuffer
from areal.controller.staleness import StalenessGate
from areal.trajectory import Trajectory
from areal.weights import retire_older_than

log = logging.getLogger("areal.controller")


class Controller:
    def __init__(self, cfg, rows: list[dict], tokenizer, workers: list[RpcClient],
                 reward: RpcClient):
        self.cfg = cfg
        self.rows = rows
        self.tokenizer = tokenizer
        self.workers = workers
        self.reward = reward
        self.gate = StalenessGate(cfg.trainer.batch_size, cfg.max_staleness,
                                  cfg.rollout.max_concurrent)
        self.buffer = ReplayBuffer()
        self.changed = asyncio.Condition()
        self.done = asyncio.Event()
        self._load = [0] * len(workers)  # groups in flight per worker
        self._retry: list[dict] = []  # prompts whose group failed: generated again first
        self._order = list(range(len(rows)))
        self._pos = 0
        self._epoch = 0
        self._update_lock = asyncio.Lock()
        self._tokens_generated = 0
        self._last_stats_time = time.time()
        self.sampling = {
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "temperature": cfg.rollout.temperature,
            "top_p": cfg.rollout.top_p,
            "top_k": cfg.rollout.top_k,
        }

    # ---- admission -------------------------------------------------------------------
    def _next_row(self) -> dict:
        if self._retry:
            return self._retry.pop(0)
        if self._pos == 0:
            random.Random(self.cfg.seed + self._epoch).shuffle(self._order)
        row = self.rows[self._order[self._pos]]
        self._pos += 1
        if self._pos == len(self._order):
            self._pos, self._epoch = 0, self._epoch + 1
        return row

    async def admit_loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        while not self.done.is_set():
            async with self.changed:
                await self.changed.wait_for(lambda: self.gate.capacity() > 0 or self.done.is_set())
                if self.done.is_set():
                    break
                start_version = self.gate.on_rollout_submitted()
                index = self.buffer.reserve(start_version)
            task = asyncio.create_task(self._rollout_group(index, self._next_row(), start_version))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for t in tasks:
            t.cancel()

    async def _rollout_group(self, index: int, row: dict, start_version: int) -> None:
        k = min(range(len(self.workers)), key=lambda j: self._load[j])
        self._load[k] += 1
        try:
            wire = await self.workers[k].call(
                "generate", group_id=index, prompt_ids=row["prompt_ids"],
                n=self.cfg.rollout.group_size, sampling_params=self.sampling,
                start_version=start_version,
            )
            trajs = [Trajectory.from_wire(w) for w in wire]
            texts = [self.tokenizer.decode(t.output_ids, skip_special_tokens=True) for t in trajs]
            rewards = await self.reward.call("grade", task=row["task"], responses=texts,
                                             answer=row["answer"])
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("group %d failed (%s); its prompt will be generated again", index, e)
            async with self.changed:
                self.gate.on_rollout_rejected()
                self.buffer.discard(index)
                self._retry.append(row)
                self.changed.notify_all()
            return
        finally:
            self._load[k] -= 1
        for t, r in zip(trajs, rewards, strict=True):
            t.reward = r
        async with self.changed:
            self._tokens_generated += sum(len(t.output_ids) for t in trajs)
            self.gate.on_rollout_accepted()
            self.buffer.put(index, trajs)
            self.changed.notify_all()

    # ---- trainer-facing RPCs ---------------------------------------------------------
    async def get_batch(self, version: int) -> dict:
        """The training batch for trainer version `version`, waiting until one may be had."""
        batch = None

        def ready() -> bool:
            nonlocal batch
            batch = self.buffer.take(version, self.cfg.trainer.batch_size, self.cfg.max_staleness)
            return batch is not None

        async with self.changed:
            await self.changed.wait_for(ready)
            self.changed.notify_all()
        trajs = [t for group in batch for t in group]
        return {"trajectories": [t.to_wire() for t in trajs], "stats": await self._stats()}

    async def _stats(self) -> dict:
        now = time.time()
        elapsed, self._last_stats_time = now - self._last_stats_time, now
        tokens, self._tokens_generated = self._tokens_generated, 0
        worker_stats = await asyncio.gather(*(w.call("stats") for w in self.workers))
        reward_stats = await self.reward.call("stats")
        return {
            "rollout/interrupted": sum(s["n_interrupted"] for s in worker_stats),
            "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
            "rollout/groups_in_flight": self.buffer.n_in_flight,
            "rollout/groups_ready": len(self.buffer),
            "reward/timeouts": reward_stats["timeouts"],
            "reward/errors": reward_stats["errors"],
        }

    async def weights_ready(self, version: int, path: str) -> dict:
        """The trainer published `version`: load it on every server, in the background."""
        asyncio.create_task(self._update_weights(version, path))
        return {}

    async def _update_weights(self, version: int, path: str) -> None:
        async with self._update_lock:  # versions are loaded in order
            await asyncio.gather(
                *(w.call("update_weights", version=version, path=path) for w in self.workers)
            )
            async with self.changed:
                self.gate.on_version(version)
                self.changed.notify_all()
            # Every server acknowledged `version`: older directories are no longer needed.
            retire_older_than(self.cfg.exp_dir, version)
            if version >= self.cfg.total_train_steps:
                self.done.set()
                async with self.changed:
                    self.changed.notify_all()


async def run_controller(cfg, tokenizer, rows: list[dict], key: bytes) -> None:
    registry = Registry(cfg.exp_dir)
    # Rollout workers register once their server is healthy, which can take minutes.
    wait_s = cfg.inference.startup_timeout_s + 60
    addresses = registry.lookup_all("rollout", cfg.rollout.n_servers, timeout=wait_s)
    workers = [RpcClient(a, key) for a in addresses]
    reward = RpcClient(registry.lookup("reward", 0, timeout=wait_s), key)
    controller = Controller(cfg, rows, tokenizer, workers, reward)
    server = RpcServer(key)
    server.register("get_batch", controller.get_batch)
    server.register("weights_ready", controller.weights_ready)
    serve = asyncio.create_task(server.serve())
    registry.register("controller", 0, server.address)
    admit = asyncio.create_task(controller.admit_loop())
    try:
        await controller.done.wait()
    finally:
        admit.cancel()
        server.close()
        await asyncio.gather(serve, admit, return_exceptions=True)
        for c in [*workers, reward]:
            c.close()
