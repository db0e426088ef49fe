"""The rollout controller: the staleness gate, the replay buffer, and the episodes between.

    Draws (draws.py) --row--> [staleness gate] --admit--> the row's group: an episode
                                  workflow.arun_episode(engine, row)               |
                                    | engine.generate --> WorkerPool (pool.py)     |
                                    | engine.grade    --> reward service           |
    trainer <--get_batch(i)-- [replay buffer] <-- the group's trajectories --------'
    trainer --weights_ready(i+1)--> WorkerPool.update_weights --> gate.on_version(i+1)
                (distributed: <--the weight-update group-- then the trainer broadcasts)

| loop            | waits for                                   | unblocked by                 |
|-----------------|---------------------------------------------|------------------------------|
| admit_loop      | gate capacity (staleness bound, in-flight)  | a finished group, a version  |
| one group       | its episode: the worker pool, the grader    | their replies, or its timeout|
| get_batch(i)    | a batch the buffer may hand out at i        | a finished group             |
| weight update   | the pool: every worker to load version i    | their replies                |

The data plane (rollout.data_plane, areal/data_plane.py): with pull (the default) the
single-turn episode generates and grades on the rollout worker, which keeps the tokens;
the gate, the buffer, dynamic sampling and the stats see TrajectoryRefs (metadata), and
get_batch hands out references that each trainer rank resolves for its own share. With
relay every trajectory comes here whole and goes whole to trainer rank 0.

The episode is pluggable (rollout.workflow, areal/workflow/): the default samples G
single-turn responses and grades them; an agent's episodes call the model through an
OpenAI-compatible endpoint. One admitted row is one group, which the gate counts once
however many calls its episodes make. A rejected or timed-out group frees its place and
its row is drawn again. Routing, failover and the weight fan-out are the pool's (pool.py).

Everything runs on one asyncio loop, so the gate, the buffer and the draws need no lock:
their state changes only between awaits, and `changed` wakes whoever waits on them. The
checkpoint state is theirs: the dataset position with the draws to generate again, and
the buffer's ready groups; groups held by rollout workers are not in it (their holders
die with the run): their draws are drawn again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal.comm.rpc import RpcClient, RpcServer
from areal.comm.wire import pack
from areal.config import RolloutConfig
from areal.controller.buffer import ReplayBuffer
from areal.controller.draws import Draws
from areal.controller.failures import FailureWatch
from areal.controller.pool import WorkerPool
from areal.controller.staleness import StalenessGate
from areal.data_plane import TrajectoryStore
from areal.process import RESTARTS_ENV
from areal.trajectory import Trajectory, TrajectoryRef
from areal.workflow import EpisodeError, EpisodeRunner, RolloutEngine, Workflow, load_workflow

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("areal.controller")


class Controller:
    def __init__(
        self,
        rows: list[dict],
        tokenizer: PreTrainedTokenizerBase,
        workers: list[RpcClient],
        reward: RpcClient | None,
        workflow: Workflow | None = None,
        data_plane: str | None = None,
        *,
        rollout: RolloutConfig,
        batch_size: int,
        max_staleness: int,
        seed: int,
        exp_dir: Path,
        ranks_per_server: int,
        dynamic_sampling: bool,
    ):
        """What it reads of the config is given to it (areal/worker.py's make_controller
        builds one from a config): the rollout section, trainer.batch_size, max_staleness,
        seed, the experiment directory, the weight-update group's ranks per server and
        ppo.dynamic_sampling."""
        self.rollout = rollout
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.dynamic_sampling = dynamic_sampling
        self.data_plane = data_plane or rollout.data_plane
        """pull | relay (rollout.data_plane; the inline run passes relay: one process)."""
        self.store = TrajectoryStore("controller0")
        """With pull: the holder of trajectories made here (agents), from get_batch on;
        areal/worker.py's run_controller sets its address."""
        self._handed_out: list[TrajectoryRef] = []  # the last batch, released at the next
        self.server: RpcServer | None = None
        """Its RPC server (areal/worker.py's run_controller's), for the bytes it moved."""
        self._bytes_moved = 0
        self._admit_to_buffer_s: list[float] = []  # per group buffered since the last batch
        self.workflow = workflow or load_workflow(rollout.workflow, rollout)
        assert isinstance(self.workflow, Workflow), "workflows subclass areal.workflow.Workflow"
        self.episodes = EpisodeRunner(self.workflow, rollout.episode_timeout_s)
        self.failures = FailureWatch(rollout.max_consecutive_failures, rollout.failure_window_s)
        self.no_progress: str | None = None
        """The report once episodes only fail (run_controller then raises NoProgress)."""
        self.stalled = asyncio.Event()
        self.rows = rows
        self.tokenizer = tokenizer
        self.reward = reward
        self.pool = WorkerPool(workers, exp_dir, ranks_per_server=ranks_per_server)
        self.draws = Draws(rows, seed)
        self.gate = StalenessGate(batch_size, max_staleness, rollout.max_concurrent)
        self.buffer = ReplayBuffer()
        self.changed = asyncio.Condition()
        """Notified whenever the gate, the buffer or the draws change."""
        self._update_lock = asyncio.Lock()  # versions load, and the gate moves, in order
        self._updates: set[asyncio.Task] = set()
        self._tokens_generated = 0
        self._dropped = 0  # groups dynamic sampling dropped since the last batch
        self._rewards = [0.0, 0]  # sum and count of the rewards of every group since then
        self._dropped_in_a_row = 0
        self._last_stats_time = time.time()
        self.restarts = int(os.environ.get(RESTARTS_ENV, "0"))
        """How many times the launcher restarted this run from a checkpoint (recovery)."""
        self.sampling = {
            "max_new_tokens": rollout.max_new_tokens,
            "temperature": rollout.temperature,
            "top_p": rollout.top_p,
            "top_k": rollout.top_k,
        }

    # ---- admission: the controller's loop ----------------------------------------------
    async def admit_loop(self) -> None:
        """Whenever the gate allows, admit the next row; its group's episode runs alone."""
        running: set[asyncio.Task] = set()
        try:
            while True:
                group = await self.admit()
                running.add(group)
                group.add_done_callback(running.discard)
        finally:
            for group in running:
                group.cancel()

    async def admit(self) -> asyncio.Task[list[Trajectory] | None]:
        """Wait for the gate, draw the next row and start its group's episode.

        The task returns the group's trajectories once they are in the buffer, or None
        where the episode declined the row (used up) or failed (the row is drawn again).
        """
        async with self.changed:
            await self.changed.wait_for(lambda: self.gate.capacity() > 0)
            start_version = self.gate.on_rollout_submitted()
            group_id = self.buffer.reserve(start_version)
            row = self.draws.next()
        t_admit = time.monotonic()
        return asyncio.create_task(self._run_group(group_id, row, start_version, t_admit))

    async def _run_group(
        self, group_id: int, row: dict, start_version: int, t_admit: float = 0.0
    ) -> list[Trajectory | TrajectoryRef] | None:
        engine = RolloutEngine(
            tokenizer=self.tokenizer,
            group_size=self.rollout.group_size,
            sampling_params=self.sampling,
            group_id=group_id,
            start_version=start_version,
            generate_fn=functools.partial(self.pool.generate, group_id, start_version),
            grade_fn=self._grade,
            generate_graded_fn=(
                functools.partial(self.pool.generate, group_id, start_version)
                if self.data_plane == "pull"
                else None
            ),
        )
        failed = dropped = False
        try:
            trajs = await self.episodes.run(engine, row)
            dropped = self._drop(trajs)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not isinstance(e, EpisodeError):  # EpisodeRunner logged the others already
                log.warning("group %d failed (%s); its prompt will be generated again", group_id, e)
            trajs, failed = None, True
            report = self.failures.rejected(e)
            if report and self.no_progress is None:
                self.no_progress = report
                self.stalled.set()
        if trajs:
            self._rewards[0] += sum(t.reward for t in trajs)
            self._rewards[1] += len(trajs)
        async with self.changed:
            # In one step with the buffer, so a checkpoint sees the row in exactly one place.
            if trajs is None or dropped:  # failed, declined by the workflow, or dropped
                if trajs:
                    self.pool.release([t for t in trajs if isinstance(t, TrajectoryRef)])
                self.gate.on_rollout_rejected()
                self.buffer.discard(group_id)
                if failed:
                    self.draws.give_back(row)
                else:
                    self.draws.used(row)
            else:
                for t in trajs:  # the buffer's group, whatever the workflow wrote
                    t.group_id, t.start_version = group_id, start_version
                    t.draw_id = row["draw_id"]
                self.draws.used(row)
                self._tokens_generated += sum(t.n_generated for t in trajs)
                self.gate.on_rollout_accepted()
                self.failures.accepted()
                self.buffer.put(group_id, trajs)
                self._admit_to_buffer_s.append(time.monotonic() - t_admit)
            self.changed.notify_all()
        return trajs

    def _drop(self, trajs: list[Trajectory] | None) -> bool:
        """Dynamic sampling (DAPO): a group whose rewards are all equal has zero advantage
        everywhere and teaches nothing; it frees its place in the gate (the staleness bound
        is unchanged) and another prompt is generated. Drops with no group kept in between
        end the run once they pass a bound, rather than generating forever."""
        if not self.dynamic_sampling or not trajs or len(trajs) < 2:
            return False
        if len({t.reward for t in trajs}) > 1:
            self._dropped_in_a_row = 0
            return False
        self._dropped += 1
        self._dropped_in_a_row += 1
        limit = max(100, 10 * self.batch_size)
        if self._dropped_in_a_row >= limit and self.no_progress is None:
            self.no_progress = (
                f"dynamic sampling dropped {self._dropped_in_a_row} groups in a row: every "
                f"group's rewards were equal (all {trajs[0].reward:g}), so no batch can be "
                "formed. The prompts are all too easy or too hard for the model: change the "
                "data or the reward, or set ppo.dynamic_sampling=false"
            )
            self.stalled.set()
        return True

    async def _grade(self, task: str, responses: list[str], answer: Any) -> list[float]:
        return await self.reward.call("grade", task=task, responses=responses, answer=answer)

    # ---- trainer-facing RPCs ---------------------------------------------------------
    async def get_batch(self, version: int) -> dict:
        """The training batch for trainer version `version`, waiting until one may be had:
        whole trajectories (relay), or references to them (pull). With pull, the batch
        handed out before this one has been trained on: its holders may drop it."""
        batch = None

        def ready() -> bool:
            nonlocal batch
            batch = self.buffer.take(version, self.batch_size, self.max_staleness)
            return batch is not None

        async with self.changed:
            await self.changed.wait_for(ready)
            self.changed.notify_all()
        trajs = [t for group in batch for t in group]
        stats = await self._stats()
        # Samples whose tokens came from more than one policy version (interrupted by updates).
        stats["rollout/multi_version_samples"] = sum(t.version_min != t.version_max for t in trajs)
        # What was trained, by identity: a resumed or recovered run trains each draw once.
        stats["batch/group_ids"] = [g[0].group_id for g in batch]
        stats["batch/draw_ids"] = [g[0].draw_id for g in batch]
        stats["recover/restarts"] = self.restarts
        if self.data_plane == "pull":
            self._release(self._handed_out)
            # Made here (agents): from now on held here, fetched like any other.
            made_here = [t for t in trajs if isinstance(t, Trajectory)]
            held = iter(self.store.hold(made_here))
            trajs = [next(held) if isinstance(t, Trajectory) else t for t in trajs]
            self._handed_out = trajs
        return {"trajectories": [t.to_wire() for t in trajs], "stats": stats}

    def bytes_moved(self) -> int:
        """Bytes of the frames the controller has sent and received over RPC."""
        ends = [*self.pool.workers, self.reward, self.server]
        return sum(getattr(e, "bytes_in", 0) + getattr(e, "bytes_out", 0) for e in ends)

    def _release(self, refs: list[TrajectoryRef]) -> None:
        self.store.release_now([r.traj_id for r in refs if r.holder == self.store.address])
        self.pool.release([r for r in refs if r.holder != self.store.address])

    async def _stats(self) -> dict:
        now = time.time()
        elapsed, self._last_stats_time = now - self._last_stats_time, now
        tokens, self._tokens_generated = self._tokens_generated, 0
        dropped, self._dropped = self._dropped, 0
        (reward_sum, n_rewards), self._rewards = self._rewards, [0.0, 0]
        pool_stats = await self.pool.stats()
        reward_stats = await self.reward.call("stats")
        if n_rewards:  # every group finished since the last batch, dropped ones too (the
            # trained batch's reward/mean is what dynamic sampling kept)
            pool_stats["rollout/reward_mean"] = reward_sum / n_rewards
        moved = self.bytes_moved()
        moved, self._bytes_moved = moved - self._bytes_moved, moved
        waits, self._admit_to_buffer_s = sorted(self._admit_to_buffer_s), []
        if waits:  # from the gate's admission to the buffer: generation, grading, queueing
            pool_stats["rollout/admit_to_buffer_p50_s"] = waits[len(waits) // 2]
            pool_stats["rollout/admit_to_buffer_p99_s"] = waits[int(0.99 * (len(waits) - 1))]
        return {
            **pool_stats,
            # Every frame in or out of the controller since the last batch (the data plane's
            # yardstick: with pull, a small share of the batch's bytes).
            "data/controller_bytes": moved,
            "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
            "rollout/groups_in_flight": self.buffer.n_in_flight,
            "rollout/groups_ready": len(self.buffer),
            "rollout/dropped_groups": dropped,
            # Screened: graded without the pool; reused: a question the pool had answered.
            **{f"reward/{k}": reward_stats[k] for k in ("graded", "screened", "reused")},
            "reward/timeouts": reward_stats["timeouts"],
            "reward/errors": reward_stats["errors"],
            **self.episodes.stats(),
            **self.workflow.stats(),
        }

    async def weights_ready(
        self,
        version: int,
        path: str | None,
        disk_version: int | None = None,
        broadcast: dict | None = None,
    ) -> dict:
        """The trainer has `version`: load it on every server, in the background. From disk
        (path), the trainer goes on at once. By broadcast (weights.transport=distributed;
        path the newest version on disk): once the previous update is done, the reply is the
        group (pool.plan_broadcast) whose servers are about to receive; the trainer then
        sends (joining first when the group is new)."""
        planned: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(
            self._load_version(version, path, disk_version, broadcast, planned)
        )
        self._updates.add(task)
        task.add_done_callback(self._updates.discard)
        if broadcast is None:
            return {}
        return await planned

    async def _load_version(
        self,
        version: int,
        path: str | None,
        disk_version: int | None,
        broadcast: dict | None,
        planned: asyncio.Future[dict],
    ) -> None:
        async with self._update_lock:
            if broadcast is not None:
                try:
                    group = self.pool.plan_broadcast(broadcast)
                except Exception as e:  # the trainer waits for the plan: it gets the error
                    planned.set_exception(e)
                    raise
                planned.set_result(group)
                sent = broadcast["delta"] if group["delta"] else broadcast  # its buckets
                broadcast = {
                    "group": group,
                    "buckets": sent["buckets"],
                    "load_format": sent.get("load_format"),
                    "lora_config": broadcast.get("lora_config"),  # how to apply an adapter
                    "path": broadcast["path"],
                }
            await self.pool.update_weights(version, path, disk_version, broadcast)
            async with self.changed:
                self.gate.on_version(version)
                self.changed.notify_all()

    # ---- checkpoint state -------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a resumed run needs: groups in flight, and ready groups whose tokens a
        rollout worker holds (lost with it when the run stops), are generated again from
        their rows."""
        state = {**self.draws.state_dict(), "buffer": self.buffer.state_dict()}
        state["retry"] += [self.draws.row(d) for d in state["buffer"].pop("held_draw_ids")]
        return state

    def load_state_dict(self, state: dict, version: int) -> None:
        self.draws.load_state_dict(state)
        self.buffer.load_state_dict(state["buffer"])
        # Rebuilt from the version, never carried over: in-flight groups were lost.
        self.gate = StalenessGate(
            self.batch_size,
            self.max_staleness,
            self.rollout.max_concurrent,
            version=version,
            n_accepted=self.batch_size * version + len(self.buffer),
        )

    async def save_state(self, path: str) -> dict:
        """Write the controller's part of a checkpoint (the trainer commits it)."""
        Path(path).write_bytes(pack(self.state_dict()))
        return {}
