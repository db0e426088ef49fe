"""The rollout controller: dataset -> generate -> reward -> buffer -> trainer.

    dataset --row--> [staleness gate] --workflow.arun_episode(engine, row)--+
                                          engine.generate --> rollout worker k
                                          engine.grade    --> reward service  |
    trainer <--get_batch(i)-- [replay buffer] <--- the row's trajectories ----+
    trainer --weights_ready(i+1)--> update every worker --> gate.on_version(i+1)
    (router.py picks the worker of a group: the least loaded alive; a dead server's samples
     come back unfinished and resume on another, until its worker answers wait_ready)

| loop            | waits for                                   | unblocked by                 |
|-----------------|---------------------------------------------|------------------------------|
| admit           | gate capacity (staleness bound, in-flight)  | a finished group, a version  |
| one group       | its episode (workflow): workers, grader     | their replies, or its timeout|
| get_batch(i)    | a batch the buffer may hand out at i        | a finished group             |
| weight update   | every worker to load version i              | their replies                |
| dead server     | its worker's wait_ready (restart + reload)  | the launcher restarting it   |

The episode is pluggable (rollout.workflow, areal/workflow/): the default samples G
single-turn responses and grades them; an agent's episodes call the model through an
OpenAI-compatible endpoint. One admitted row is one unit of the gate, however many calls
its episodes make. A rejected or timed-out unit frees its place and its row comes back.

Everything runs on one asyncio loop, so the gate and the buffer need no lock: their
state changes only between awaits, and `changed` wakes whoever waits on them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import signal
import time
from pathlib import Path

from areal import events, rolelog
from areal.checkpoint import Checkpoint
from areal.comm.registry import Registry
from areal.comm.rpc import RpcClient, RpcServer
from areal.comm.wire import pack, unpack
from areal.controller.buffer import ReplayBuffer
from areal.controller.router import Router
from areal.controller.staleness import StalenessGate
from areal.process import RESTARTS_ENV
from areal.trajectory import Trajectory
from areal.weights import retire_older_than
from areal.workflow import EpisodeError, EpisodeRunner, RolloutEngine, Workflow, load_workflow

log = logging.getLogger("areal.controller")


class Controller:
    def __init__(
        self,
        cfg,
        rows: list[dict],
        tokenizer,
        workers: list[RpcClient],
        reward: RpcClient,
        workflow: Workflow | None = None,
    ):
        self.cfg = cfg
        self.workflow = workflow or load_workflow(cfg.rollout.workflow, cfg.rollout)
        self.episodes = EpisodeRunner(self.workflow, cfg.rollout.episode_timeout_s)
        self.rows = rows
        self.tokenizer = tokenizer
        self.workers = workers
        self.reward = reward
        self.gate = StalenessGate(
            cfg.trainer.batch_size, cfg.max_staleness, cfg.rollout.max_concurrent
        )
        self.buffer = ReplayBuffer()
        self.changed = asyncio.Condition()
        self.router = Router(len(workers))
        self._watchers: dict[int, asyncio.Task] = {}  # dead server -> waiting for it to be back
        self._resubmitted = 0  # samples resumed on another server, since the last step
        self._retry: list[dict] = []  # prompts whose group failed: generated again first
        self._rows_in_flight: dict[int, dict] = {}  # buffer index -> its prompt
        self._epoch = 0
        self._pos = 0
        self._order = self._epoch_order(0)
        self._update_lock = asyncio.Lock()
        self._tokens_generated = 0
        self._last_stats_time = time.time()
        self.restarts = int(os.environ.get(RESTARTS_ENV, "0"))
        """How many times the launcher restarted this run from a checkpoint (recovery)."""
        self.sampling = {
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "temperature": cfg.rollout.temperature,
            "top_p": cfg.rollout.top_p,
            "top_k": cfg.rollout.top_k,
        }

    # ---- admission -------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.cfg.seed + epoch).shuffle(order)
        return order

    def _next_row(self) -> dict:
        if self._retry:
            return self._retry.pop(0)
        draw = self._epoch * len(self.rows) + self._pos
        row = {**self.rows[self._order[self._pos]], "draw_id": draw}
        self._pos += 1
        if self._pos == len(self._order):
            self._epoch, self._pos = self._epoch + 1, 0
            self._order = self._epoch_order(self._epoch)
        return row

    async def admit_loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            await self._admit_forever(tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _admit_forever(self, tasks: set[asyncio.Task]) -> None:
        while True:
            async with self.changed:
                await self.changed.wait_for(lambda: self.gate.capacity() > 0)
                start_version = self.gate.on_rollout_submitted()
                index = self.buffer.reserve(start_version)
                row = self._rows_in_flight[index] = self._next_row()
            task = asyncio.create_task(self._rollout_group(index, row, start_version))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _rollout_group(self, index: int, row: dict, start_version: int) -> None:
        engine = RolloutEngine(
            tokenizer=self.tokenizer,
            group_size=self.cfg.rollout.group_size,
            sampling_params=self.sampling,
            group_id=index,
            start_version=start_version,
            generate_fn=functools.partial(self._generate, index, start_version),
            grade_fn=self._grade,
        )
        try:
            trajs = await self.episodes.run(engine, row)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not isinstance(e, EpisodeError):  # EpisodeRunner logged the others already
                log.warning("group %d failed (%s); its prompt will be generated again", index, e)
            async with self.changed:
                self.gate.on_rollout_rejected()
                self.buffer.discard(index)
                self._retry.append(self._rows_in_flight.pop(index))
                self.changed.notify_all()
            return
        if trajs is None:  # declined by the workflow: the row is used up
            async with self.changed:
                self.gate.on_rollout_rejected()
                self.buffer.discard(index)
                self._rows_in_flight.pop(index)
                self.changed.notify_all()
            return
        for t in trajs:  # the buffer's group, whatever the workflow wrote
            t.group_id, t.start_version = index, start_version
            t.draw_id = row["draw_id"]
        async with self.changed:
            # In one step with the buffer, so a checkpoint sees the group in exactly one place.
            self._rows_in_flight.pop(index)
            self._tokens_generated += sum(t.n_generated for t in trajs)
            self.gate.on_rollout_accepted()
            self.buffer.put(index, trajs)
            self.changed.notify_all()

    async def _grade(self, task: str, responses: list[str], answer) -> list[float]:
        return await self.reward.call("grade", task=task, responses=responses, answer=answer)

    async def _generate(
        self, index: int, start_version: int, prompt_ids: list[int], n: int, sampling: dict
    ) -> list[Trajectory]:
        """n finished trajectories continuing prompt_ids, on one server; samples a dead
        server left unfinished are resumed, with their partial output, on another."""
        done: list[Trajectory] = []
        partial: list[dict] | None = None  # None: nothing generated yet
        k = None
        while True:
            async with self.changed:
                await self.changed.wait_for(self.router.any_alive)
                k = self.router.pick(preferred=k)
                self.router.load[k] += 1
            try:
                wire = await self.workers[k].call(
                    "generate",
                    group_id=index,
                    prompt_ids=prompt_ids,
                    n=n,
                    sampling_params=sampling,
                    start_version=start_version,
                    partial=partial,
                )
            finally:
                self.router.load[k] -= 1
            trajs = [Trajectory.from_wire(w) for w in wire]
            done += [t for t in trajs if t.finish_reason]
            partial = [t.to_wire() for t in trajs if not t.finish_reason]
            if not partial:
                return done
            self._server_down(k)
            self._resubmitted += len(partial)

    def _server_down(self, k: int) -> None:
        """Route around server k until its worker says it serves again."""
        self.router.mark_dead(k)
        if k not in self._watchers:
            log.warning("inference server %d is down; routing around it until it is back", k)
            self._watchers[k] = asyncio.create_task(self._wait_back(k))

    async def _wait_back(self, k: int) -> None:
        try:
            reply = await self.workers[k].call("wait_ready")
        finally:
            del self._watchers[k]
        async with self.changed:
            self.router.mark_alive(k, reply["version"])
            self.changed.notify_all()
        log.info("inference server %d is back at version %d", k, reply["version"])

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
        stats = await self._stats()
        # Samples whose tokens came from more than one policy version (interrupted by updates).
        stats["rollout/multi_version_samples"] = sum(len(set(t.versions)) > 1 for t in trajs)
        # What was trained, by identity: a resumed or recovered run trains each draw once.
        stats["batch/group_ids"] = [g[0].group_id for g in batch]
        stats["batch/draw_ids"] = [g[0].draw_id for g in batch]
        stats["recover/restarts"] = self.restarts
        return {"trajectories": [t.to_wire() for t in trajs], "stats": stats}

    async def _stats(self) -> dict:
        now = time.time()
        elapsed, self._last_stats_time = now - self._last_stats_time, now
        tokens, self._tokens_generated = self._tokens_generated, 0
        resubmitted, self._resubmitted = self._resubmitted, 0
        worker_stats = await asyncio.gather(*(w.call("stats") for w in self.workers))
        reward_stats = await self.reward.call("stats")
        return {
            "rollout/interrupted": sum(s["n_interrupted"] for s in worker_stats),
            "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
            "rollout/groups_in_flight": self.buffer.n_in_flight,
            "rollout/groups_ready": len(self.buffer),
            "rollout/servers_alive": sum(self.router.alive),
            # The oldest weights a serving server holds (as it acknowledged them).
            "rollout/server_version_min": min(
                (v for v, ok in zip(self.router.version, self.router.alive, strict=True) if ok),
                default=-1,
            ),
            "rollout/resubmitted": resubmitted,
            "reward/timeouts": reward_stats["timeouts"],
            "reward/errors": reward_stats["errors"],
            **self.episodes.stats(),
            **(self.workflow.stats() if hasattr(self.workflow, "stats") else {}),
        }

    def state_dict(self) -> dict:
        """What a resumed run needs: groups in flight are generated again from their prompts."""
        return {
            "epoch": self._epoch,
            "pos": self._pos,
            "retry": list(self._rows_in_flight.values()) + self._retry,
            "buffer": self.buffer.state_dict(),
        }

    def load_state_dict(self, state: dict, version: int) -> None:
        self._epoch, self._pos = state["epoch"], state["pos"]
        self._order = self._epoch_order(self._epoch)
        self._retry = list(state["retry"])
        self.buffer.load_state_dict(state["buffer"])
        # Rebuilt from the version, never carried over: in-flight groups were lost.
        self.gate = StalenessGate(
            self.cfg.trainer.batch_size,
            self.cfg.max_staleness,
            self.cfg.rollout.max_concurrent,
            version=version,
            n_accepted=self.cfg.trainer.batch_size * version + len(self.buffer),
        )

    async def save_state(self, path: str) -> dict:
        """Write the controller's part of a checkpoint (the trainer commits it)."""
        Path(path).write_bytes(pack(self.state_dict()))
        return {}

    async def weights_ready(self, version: int, path: str) -> dict:
        """The trainer published `version`: load it on every server, in the background."""
        asyncio.create_task(self._update_weights(version, path))
        return {}

    async def _update_weights(self, version: int, path: str) -> None:
        async with self._update_lock:  # versions are loaded in order
            t0 = time.time()
            replies = await asyncio.gather(
                *(w.call("update_weights", version=version, path=path) for w in self.workers)
            )
            events.record("update_weights", t0, time.time(), version=version)
            rolelog.set_context(version=version)
            log.info("version %d loaded by the servers in %.2fs", version, time.time() - t0)
            async with self.changed:
                for k, reply in enumerate(replies):
                    if reply["loaded"]:
                        self.router.version[k] = reply["version"]
                    else:  # down: it loads the newest version before it serves again
                        self._server_down(k)
                self.gate.on_version(version)
                self.changed.notify_all()
            # Every server serving holds `version`, and one that comes back loads the newest
            # first: older directories are no longer needed.
            retire_older_than(self.cfg.exp_dir, version)


async def run_controller(
    cfg, tokenizer, rows: list[dict], key: bytes, resume_from: Checkpoint | None = None
) -> None:
    registry = Registry(cfg.exp_dir)
    # Rollout workers register once their server is healthy, which can take minutes.
    wait_s = cfg.inference.startup_timeout_s + 60
    addresses = registry.lookup_all("rollout", cfg.rollout.n_servers, timeout=wait_s)
    workers = [RpcClient(a, key) for a in addresses]
    reward = RpcClient(registry.lookup("reward", 0, timeout=wait_s), key)
    controller = Controller(cfg, rows, tokenizer, workers, reward)
    if resume_from is not None:
        controller.load_state_dict(
            unpack(resume_from.controller_state.read_bytes()), resume_from.version
        )
        log.info(
            "resumed at version %d with %d ready groups",
            resume_from.version,
            len(controller.buffer),
        )
    server = RpcServer(key)
    server.register("get_batch", controller.get_batch)
    server.register("weights_ready", controller.weights_ready)
    server.register("save_state", controller.save_state)
    serve = asyncio.create_task(server.serve())
    registry.register("controller", 0, server.address)
    admit = asyncio.create_task(controller.admit_loop())
    # The run ends when the trainer has finished and the launcher stops us.
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({serve, admit, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped not in done:  # a loop that ends by itself is a failure: surface it
            for t in done:
                t.result()
            raise RuntimeError("a controller loop ended unexpectedly")
    finally:
        admit.cancel()
        stopped.cancel()
        server.close()
        await asyncio.gather(serve, admit, stopped, return_exceptions=True)
        for c in [*workers, reward]:
            c.close()
        if hasattr(controller.workflow, "aclose"):  # an agent's endpoint
            await controller.workflow.aclose()
