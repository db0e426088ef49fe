"""The trainer worker: batch in, PPO update, weights out, one line of metrics.

One loop, the same on every rank of the trainer world (`train`: `Trainer.step` up to
total_train_steps, over the objects areal/worker.py's `make_trainer` builds, its settings a
StepPlan; areal.build's Run calls the same three phases from your loop); what only global
rank 0 does in it (`dp.is_main`) talks to the controller and writes files:

    step: version i -> i+1, on every rank
    next_batch:
      get_batch(i): rank 0 asks the controller --broadcast--> every other rank
               rollout.data_plane=pull: the reply is the batch's metadata; every rank
               fetches the tokens of its own share from their holders (data_plane.py)
      step.prepare: proximal log-probs, advantages, masks of this rank's share
    step.ppo_update: the minibatch updates on this rank's share
    publish:
      weights: rank 0 writes weights/v(i+1)/ + weights_ready(i+1) --> controller
               (collective backend: every rank contributes its slices of the weights)
               weights.transport=distributed: rank 0 broadcasts v(i+1) to the servers
               (trainer/broadcast.py), to disk every few versions in the background
      rank 0: one line of metrics.jsonl and of batches.jsonl
      save due? rank 0 decides --broadcast--> every rank; if so, a checkpoint of v(i+1):
               rank 0 writes and commits it with the controller's state
               (collective backend: every rank writes its slices and optimizer file)

| waits for                             | unblocked by                                    |
|---------------------------------------|-------------------------------------------------|
| get_batch(i) (rank 0)                 | the buffer holding a batch allowed at version i |
| the batch's broadcast (ranks > 0)     | rank 0 receiving it                             |
| the save decision's broadcast (> 0)   | rank 0 having published and written metrics     |
| a collective save_hf / save_optimizer | every rank reaching it                          |

It never waits for the inference servers: they load each version while it trains on.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from areal import checkpoint, events, rolelog
from areal.checkpoint import CONTROLLER_STATE, load_trainer_state, save_trainer_state
from areal.comm.rpc import SyncRpcClient
from areal.cores import Cores
from areal.data_plane import Puller
from areal.trainer.backend import TrainerBackend
from areal.trainer.broadcast import WeightBroadcaster
from areal.trainer.parallel import DataParallel
from areal.trainer.ppo_config import PPOConfig
from areal.trainer.step import StepBatch, batch_split, ppo_update, prepare
from areal.trajectory import Trajectory, TrajectoryRef, is_ref
from areal.weights import publish

if TYPE_CHECKING:
    from areal.trainer.critic import TorchCritic

log = logging.getLogger("areal.trainer")


@dataclass(frozen=True)
class StepPlan:
    """What every step reads of the config, resolved once when the trainer is built
    (areal/worker.py's step_plan): step.prepare's settings, where the run's files go, when
    to save a checkpoint and when to stop."""

    ppo: PPOConfig
    max_new_tokens: int  # rollout.max_new_tokens
    max_tokens_per_mb: int  # trainer.mb_spec
    min_n_mbs: int
    seed: int  # the run's; the step from version i shuffles with seed + i
    value_clip: float | None  # critic.value_clip (ppo.adv_estimator=gae)
    exp_dir: Path
    total_train_steps: int
    save_freq_steps: int  # trainer.save_freq_steps (0: off)
    save_freq_s: float  # trainer.save_freq_s (0: off)
    distributed: bool  # weights.transport=distributed

    def prepare_args(self, version: int) -> dict:
        """step.prepare's (train_step's) arguments for the step from `version` to
        version + 1."""
        return dict(
            ppo=self.ppo,
            max_new_tokens=self.max_new_tokens,
            max_tokens_per_mb=self.max_tokens_per_mb,
            min_n_mbs=self.min_n_mbs,
            seed=self.seed + version,  # the same shuffle on every rank
            version=version,
            value_clip=self.value_clip,
        )

    def save_rule(self, version: int, seconds_since_save: float) -> bool:
        """Checkpoint `version`? After the last step, every trainer.save_freq_steps, or when
        trainer.save_freq_s passed since the last save."""
        freq = self.save_freq_steps
        if version == self.total_train_steps or (freq and version % freq == 0):
            return True
        return bool(self.save_freq_s and seconds_since_save >= self.save_freq_s)


def staleness(trajs: list[Trajectory | TrajectoryRef], version: int) -> list[int]:
    """Trainer version minus the oldest token version of each sample."""
    return [version - (t.version_min if t.n_output else version) for t in trajs]


def last_time(metrics_path: Path) -> float:
    """Seconds the run had lasted at its last metrics line (0 for a fresh run)."""
    if not metrics_path.exists():
        return 0.0
    lines = metrics_path.read_text().splitlines()
    return json.loads(lines[-1])["time"] if lines else 0.0


def write_trainer_part(
    backend: TrainerBackend, directory: Path | None, critic: TorchCritic | None = None
) -> None:
    """The trainer's part of a checkpoint: the HF weights (model/), the optimizer file(s)
    and trainer.json, and the critic's weights and optimizer (critic.*) when it has one.
    Global rank 0 passes the directory being written; with a collective backend every
    other rank calls it at the same step with None, contributing its weight slices and
    optimizer file before global rank 0 returns (and commits)."""
    assert directory is not None or backend.collective_save
    backend.save_hf(None if directory is None else directory / "model")
    backend.save_optimizer(directory)
    if directory is not None:
        save_trainer_state(directory, backend.state_dict())
        if critic is not None:
            critic.save(directory)


def load_trainer_part(
    backend: TrainerBackend, directory: Path, critic: TorchCritic | None = None
) -> None:
    """Every rank: the state write_trainer_part saved (trainer.json before the optimizer
    file(s): it says which layout they were written for), the critic's too."""
    backend.load_state_dict(load_trainer_state(directory))
    backend.load_optimizer(directory)
    if critic is not None:
        critic.load(directory)


def publish_weights(
    plan: StepPlan,
    backend: TrainerBackend,
    controller: SyncRpcClient | None,
    version: int,
    dp: DataParallel,
    broadcaster: WeightBroadcaster | None = None,
) -> None:
    """Hand `version` to the servers (global rank 0 tells the controller): weights/v{version}/
    on disk, or by broadcast (weights.transport=distributed: the broadcaster). With a
    collective backend the other ranks contribute their slices of the weights."""
    if broadcaster is not None:  # global rank 0, by broadcast
        with events.span("publish", version=version):
            broadcaster.publish(controller, version, backend.hf_tensors())
    elif plan.distributed and backend.collective_save:
        backend.hf_tensors()  # this rank's slices, gathered to global rank 0
    elif dp.is_main:
        with events.span("publish", version=version):
            path = publish(plan.exp_dir, version, backend.save_hf)
            controller.call("weights_ready", version=version, path=str(path))
    elif backend.collective_save:
        backend.save_hf(None)


def save_checkpoint(
    exp_dir: Path,
    backend: TrainerBackend,
    controller: SyncRpcClient | None,
    version: int,
    dp: DataParallel,
    critic: TorchCritic | None = None,
) -> None:
    """Trainer and controller state of `version`, committed together by global rank 0; with
    a collective backend the other ranks write their parts first."""
    if dp.is_main:

        def write(directory: Path) -> None:
            write_trainer_part(backend, directory, critic)
            controller.call("save_state", path=str(directory / CONTROLLER_STATE))

        with events.span("checkpoint", version=version):
            checkpoint.save(exp_dir, version, write)
    elif backend.collective_save:
        write_trainer_part(backend, None)


def save_due(plan: StepPlan, version: int, t_saved: float, dp: DataParallel) -> bool:
    """plan.save_rule on global rank 0 (its clock), the same answer on every rank: a
    collective save needs all of them, and their clocks differ."""
    due = plan.save_rule(version, time.time() - t_saved) if dp.is_main else None
    return bool(dp.broadcast_object(due))


def _get_batch(controller: SyncRpcClient | None, version: int, dp: DataParallel) -> dict:
    """Rank 0 asks the controller; the other ranks receive rank 0's copy of the reply."""
    rolelog.set_context(step=version + 1, version=version)
    with events.span("wait_batch", version=version):
        reply = controller.call("get_batch", version=version) if dp.is_main else None
        return dp.broadcast_object(reply)


def batch_trajectories(
    plan: StepPlan, reply: dict, version: int, dp: DataParallel, puller: Puller
) -> tuple[list[Trajectory | TrajectoryRef], dict[str, float]]:
    """The batch as step.prepare takes it, and what this rank received of it. Relay: whole
    trajectories. Pull: references, with this rank's own share (the split step.prepare
    makes, from the lengths) whole; the others stay references. The replica's head fetches
    the share from the holders (one round trip to each) and sends it to the replica's other
    tensor and pipeline ranks, within that group only; data/pulled_bytes counts what came
    from the holders."""
    wires = reply["trajectories"]
    if not wires or not is_ref(wires[0]):
        return [Trajectory.from_wire(d) for d in wires], {}
    trajs: list[Trajectory | TrajectoryRef] = [TrajectoryRef.from_wire(d) for d in wires]
    seqlens = [t.n_prompt + t.n_output for t in trajs]
    *_, mine = batch_split(seqlens, plan.ppo.n_minibatches, plan.prepare_args(version)["seed"], dp)
    before = puller.bytes_in
    with events.span("pull", version=version, seqs=len(mine)):
        share = puller.pull([trajs[i] for i in mine]) if dp.replica_head else None
        if dp.model_parallel is not None:
            sent = dp.from_replica_head(None if share is None else [t.to_wire() for t in share])
            if share is None:
                share = [Trajectory.from_wire(d) for d in sent]
        for i, t in zip(mine, share, strict=True):
            trajs[i] = t
    received = float(puller.bytes_in - before)
    total, most = dp.all_reduce([received], "sum")[0], dp.all_reduce([received], "max")[0]
    return trajs, {"data/pulled_bytes": total, "data/pulled_bytes_rank_max": most}


def batch_line(version: int, trajs: list[Trajectory | TrajectoryRef], stale: list[int]) -> dict:
    """One line of batches.jsonl: the per-sample figures behind the metrics of the step
    that made `version` (the report's staleness and output-length distributions)."""
    return {
        "step": version,
        "output_len": [t.n_output for t in trajs],
        "staleness": stale,
        "reward": [t.reward for t in trajs],
    }


@dataclass
class _Pending:
    """A batch between next_batch and publish, with what the metrics line takes of its
    arrival: the controller's statistics, this rank's received bytes, the time it came."""

    batch: StepBatch
    batch_stats: dict
    received: dict[str, float]
    t_batch: float


@dataclass
class Trainer:
    """One trainer rank's built objects and the step they take together (the module doc's
    loop body). `plan` gives settings only (the step's arguments, where weights go, when to
    save); the model, its optimizer and the controller are the objects passed in."""

    plan: StepPlan
    backend: TrainerBackend
    dp: DataParallel
    controller: SyncRpcClient | None  # global rank 0's; None on the other ranks
    cores: Cores
    puller: Puller
    ref: TrainerBackend | None = None  # the frozen reference policy (ppo.kl_coef > 0)
    critic: TorchCritic | None = None  # the value model (ppo.adv_estimator=gae)
    version: int = 0  # completed trainer updates: the weights this rank holds
    metrics: Metrics | None = None  # global rank 0's metrics.jsonl and batches.jsonl
    broadcaster: WeightBroadcaster | None = None  # weights.transport=distributed, rank 0
    t_saved: float = field(default_factory=time.time)
    pending: _Pending | None = None  # next_batch's, until publish

    def step(self) -> dict[str, float]:
        """One step, version i -> i+1: its batch prepared, the PPO update, the new version
        published. Returns the step's metrics line (global rank 0; elsewhere its stats)."""
        batch = self.next_batch()
        return self.publish(batch, ppo_update(self.backend, batch, self.critic))

    def next_batch(self) -> StepBatch:
        """The batch of the step from this version (the controller's, the oldest that
        max_staleness allows), this rank's share fetched and prepared (step.prepare:
        proximal log-probs, advantages, masks), ready for step.ppo_update."""
        plan, dp, version = self.plan, self.dp, self.version
        self.cores.wait()  # lends its cores to the servers until its batch comes
        reply = _get_batch(self.controller, version, dp)
        self.cores.work()
        trajs, received = batch_trajectories(plan, reply, version, dp, self.puller)
        t_batch = time.time()
        batch = prepare(
            self.backend, trajs, dp=dp, ref=self.ref, critic=self.critic,
            **plan.prepare_args(version),
        )  # fmt: skip
        self.pending = _Pending(batch, reply["stats"], received, t_batch)
        return batch

    def publish(self, batch: StepBatch, stats: dict[str, float]) -> dict[str, float]:
        """After ppo_update(batch) gave `stats`: the new version's weights to the servers,
        the step's metrics line, a checkpoint when one is due. Returns the metrics line
        (global rank 0; elsewhere `stats` and what this rank measured)."""
        pending, self.pending = self.pending, None
        if pending is None or pending.batch is not batch:
            raise RuntimeError(
                "publish(batch, stats) takes the batch of the last next_batch(), once, after "
                "ppo_update(batch) (or call step(), which does all three)"
            )
        plan, dp = self.plan, self.dp
        stats = {**stats, **pending.received}
        t_train = time.time() - pending.t_batch
        stats["time/train_threads"] = self.cores.threads_mean()
        stale = staleness(batch.trajs, self.version)
        self.version = version = self.version + 1  # this rank holds the new version's weights
        publish_weights(plan, self.backend, self.controller, version, dp, self.broadcaster)
        if self.broadcaster is not None:
            stats.update(self.broadcaster.stats)
        if self.metrics is not None:  # global rank 0
            rolelog.set_context(version=version)
            log.info("trained in %.2fs, published version %d", t_train, version)
            stats = self.metrics.write(
                version, batch.trajs, stale, stats, pending.batch_stats, pending.t_batch, t_train
            )
        if save_due(plan, version, self.t_saved, dp):
            save_checkpoint(plan.exp_dir, self.backend, self.controller, version, dp, self.critic)
            self.t_saved = time.time()
        return stats

    def close(self) -> None:
        """After the last step, on every rank (rank 0 may still be writing a checkpoint)."""
        self.dp.barrier()
        self.puller.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.controller is not None:
            self.controller.close()
        if self.broadcaster is not None:
            self.broadcaster.close()


def train(trainer: Trainer) -> None:
    """The loop of one rank: steps up to total_train_steps, then close."""
    while trainer.version < trainer.plan.total_train_steps:
        trainer.step()
    trainer.close()


class Metrics:
    """Global rank 0's metrics.jsonl and batches.jsonl, one line each per step."""

    def __init__(self, exp_dir: Path, dp: DataParallel):
        metrics_path = exp_dir / "metrics.jsonl"
        self.dp = dp
        self.t_last = time.time()
        self.t_start = self.t_last - last_time(metrics_path)  # a resumed run's clock goes on
        self.metrics = open(metrics_path, "a")
        self.batches = open(exp_dir / "batches.jsonl", "a")

    def write(
        self,
        version: int,
        trajs: list[Trajectory],
        stale: list[int],
        stats: dict[str, float],
        batch_stats: dict,
        t_batch: float,
        t_train: float,
    ) -> dict[str, float]:
        """Writes and returns the line of the step that made `version`."""
        now = time.time()
        record = {
            "step": version,
            "version": version,
            "time": now - self.t_start,
            "reward/mean": stats.pop("reward/mean"),
            "staleness/max": max(stale),
            "staleness/mean": sum(stale) / len(stale),
            "throughput/train_tokens_per_s": stats["train/n_tokens"] / (now - self.t_last),
            "time/train_s": t_train,
            "time/wait_batch_s": t_batch - self.t_last,
            "trainer/dp": self.dp.world_size,
            **stats,
            **batch_stats,
        }
        self.t_last = now
        self.batches.write(json.dumps(batch_line(version, trajs, stale)) + "\n")
        self.batches.flush()  # before metrics: a reader that sees a step finds its batch
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        return record

    def close(self) -> None:
        self.metrics.close()
        self.batches.close()
