"""The trainer worker: batch in, PPO update, weights out, one line of metrics.

    controller --get_batch(i)--> trainer rank 0 --broadcast--> ranks 1..world-1
    every rank: proximal log-probs, advantages, minibatch updates on its share
    rank 0 --weights/v(i+1)/ + weights_ready(i+1)--> controller

| waits for                         | unblocked by                                    |
|-----------------------------------|-------------------------------------------------|
| get_batch(i) (rank 0)             | the buffer holding a batch allowed at version i |
| the batch's broadcast (ranks > 0) | rank 0 receiving it                             |

It never waits for the inference servers: they load each version while it trains on.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from areal import checkpoint, events, rolelog
from areal.checkpoint import CONTROLLER_STATE, latest, load_trainer_state, save_trainer_state
from areal.comm.registry import Registry
from areal.comm.rpc import SyncRpcClient
from areal.launcher.plan import role_threads
from areal.trainer.parallel import DataParallel, init_data_parallel
from areal.trainer.step import train_step
from areal.trainer.torch_backend import TorchBackend
from areal.trajectory import Trajectory
from areal.weights import publish

log = logging.getLogger("areal.trainer")


def make_backend(cfg, model_dir, dp: DataParallel):
    """The configured backend, and `dp` narrowed to its data-parallel group (megatron)."""
    t = cfg.trainer
    n_updates = cfg.total_train_steps * cfg.ppo.n_minibatches
    common = dict(
        lr=t.lr,
        weight_decay=t.weight_decay,
        betas=t.betas,
        adam_eps=t.adam_eps,
        grad_clip=t.grad_clip,
        warmup_steps=int(t.warmup_steps_ratio * n_updates),
        dtype=cfg.model.dtype,
        temperature=cfg.rollout.temperature,
    )
    if t.backend == "torch":
        device = str(dp.device) if dp.device.type == "cuda" else None
        return TorchBackend(model_dir, device=device, **common), dp
    # Lazy: the torch path never imports megatron.
    from areal.trainer.megatron.backend import MegatronBackend, data_parallel_group

    backend = MegatronBackend(
        model_dir,
        tp=t.parallel.tp,
        pp=t.parallel.pp,
        save_dtype=t.save_dtype,
        seed=cfg.seed,
        **common,
    )
    return backend, data_parallel_group(dp)


def staleness(trajs: list[Trajectory], version: int) -> list[int]:
    """Trainer version minus the oldest token version of each sample."""
    return [version - min(t.versions, default=version) for t in trajs]


def last_time(metrics_path: Path) -> float:
    """Seconds the run had lasted at its last metrics line (0 for a fresh run)."""
    if not metrics_path.exists():
        return 0.0
    lines = metrics_path.read_text().splitlines()
    return json.loads(lines[-1])["time"] if lines else 0.0


def save_checkpoint(cfg, backend, controller: SyncRpcClient, version: int) -> None:
    """Trainer and controller state of `version`, committed together (global rank 0)."""

    def write(directory: Path) -> None:
        write_trainer_part(backend, directory)
        controller.call("save_state", path=str(directory / CONTROLLER_STATE))

    checkpoint.save(cfg.exp_dir, version, write)


def write_trainer_part(backend, directory: Path | None) -> None:
    """The trainer's part of a checkpoint. With a model-parallel backend every rank calls
    it at the same step (directory None on ranks > 0): they contribute weight slices and
    write their own optimizer files before global rank 0 returns and commits."""
    collective = getattr(backend, "collective_save", False)
    if directory is None:
        assert collective
        backend.save_hf(None)
        backend.save_optimizer(None)
        return
    backend.save_hf(directory / "model")
    if collective:
        backend.save_optimizer(directory)
    save_trainer_state(directory, backend.state_dict())


def load_trainer_part(backend, directory: Path) -> None:
    """Every rank: the state write_trainer_part saved."""
    backend.load_state_dict(load_trainer_state(directory))
    if getattr(backend, "collective_save", False):
        backend.load_optimizer(directory)


def run_trainer(cfg, key: bytes, index: int = 0) -> None:
    """One trainer rank; `index` is its rank in the trainer world (0 without parallelism)."""
    par = cfg.trainer.parallel
    dp = init_data_parallel(par.dp, index, par.timeout_s, model_parallel=par.tp * par.pp)
    try:
        _train(cfg, key, dp)
    finally:
        dp.close()


def _get_batch(controller: SyncRpcClient | None, version: int, dp: DataParallel) -> dict:
    """Rank 0 asks the controller; the other ranks receive rank 0's copy of the reply."""
    rolelog.set_context(step=version + 1, version=version)
    with events.span("wait_batch", version=version):
        reply = controller.call("get_batch", version=version) if dp.is_main else None
        return dp.broadcast_object(reply)


def batch_line(step: int, trajs: list[Trajectory], stale: list[int]) -> dict:
    """One line of batches.jsonl: the per-sample figures behind a step's metrics (the
    report's staleness and output-length distributions)."""
    return {
        "step": step,
        "output_len": [len(t.output_ids) for t in trajs],
        "staleness": stale,
        "reward": [t.reward for t in trajs],
    }


def _train(cfg, key: bytes, dp: DataParallel) -> None:
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(role_threads(cfg.trainer.num_threads))
    # Every rank loads the same weights and optimizer state, so that identical summed
    # gradients keep them identical; rank 0 alone writes them back.
    resume_from = latest(cfg.exp_dir) if cfg.resume else None
    model_dir = resume_from.model_dir if resume_from else cfg.model.path
    backend, dp = make_backend(cfg, model_dir, dp)
    version = 0
    if resume_from:
        load_trainer_part(backend, resume_from.path)
        version = resume_from.version
    if not dp.is_main:
        for step in range(version, cfg.total_train_steps):
            trajs = [Trajectory.from_wire(d) for d in _get_batch(None, version, dp)["trajectories"]]
            train_step(backend, trajs, dp=dp, **_step_args(cfg, step))
            version += 1
            if getattr(backend, "collective_save", False):
                # Model-parallel ranks hold slices of the weights rank 0 publishes: they take
                # part in every save_hf of rank 0 (publish, and checkpoints).
                backend.save_hf(None)
                freq = cfg.trainer.save_freq_steps
                if version == cfg.total_train_steps or (freq and version % freq == 0):
                    write_trainer_part(backend, None)
        dp.barrier()  # rank 0 may still be writing the last checkpoint
        return
    wait_s = cfg.inference.startup_timeout_s + 120  # the controller waits for the servers
    controller = SyncRpcClient(Registry(cfg.exp_dir).lookup("controller", 0, timeout=wait_s), key)
    metrics_path = cfg.exp_dir / "metrics.jsonl"
    t_last = time.time()
    t_start = t_last - last_time(metrics_path)  # a resumed run's clock goes on
    t_saved = t_last
    with open(metrics_path, "a") as metrics, open(cfg.exp_dir / "batches.jsonl", "a") as batches:
        for step in range(version, cfg.total_train_steps):
            reply = _get_batch(controller, version, dp)
            trajs = [Trajectory.from_wire(d) for d in reply["trajectories"]]
            t_batch = time.time()
            stats = train_step(backend, trajs, dp=dp, **_step_args(cfg, step))
            t_train = time.time() - t_batch
            stale = staleness(trajs, version)
            version += 1
            with events.span("publish", version=version):
                path = publish(cfg.exp_dir, version, backend.save_hf)
                controller.call("weights_ready", version=version, path=str(path))
            now = time.time()
            rolelog.set_context(version=version)
            log.info("trained in %.2fs, published version %d", t_train, version)
            record = {
                "step": step + 1,
                "version": version,
                "time": now - t_start,
                "reward/mean": stats.pop("reward/mean"),
                "staleness/max": max(stale),
                "staleness/mean": sum(stale) / len(stale),
                "throughput/train_tokens_per_s": stats["train/n_tokens"] / (now - t_last),
                "time/train_s": t_train,
                "time/wait_batch_s": t_batch - t_last,
                "trainer/dp": dp.world_size,
                **stats,
                **reply["stats"],
            }
            t_last = now
            batches.write(json.dumps(batch_line(step + 1, trajs, stale)) + "\n")
            batches.flush()  # before metrics: a reader that sees a step finds its batch
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if _save_due(cfg, backend, version, t_saved):
                with events.span("checkpoint", version=version):
                    save_checkpoint(cfg, backend, controller, version)
                t_saved = time.time()
    dp.barrier()
    controller.close()


def _save_due(cfg, backend, version: int, t_saved: float) -> bool:
    """After the last step, every save_freq_steps, or save_freq_s after the last save
    (rank 0 alone decides by time: not with a backend whose ranks all take part in a save)."""
    freq, freq_s = cfg.trainer.save_freq_steps, cfg.trainer.save_freq_s
    if version == cfg.total_train_steps or (freq and version % freq == 0):
        return True
    timed = freq_s and not getattr(backend, "collective_save", False)
    return bool(timed and time.time() - t_saved >= freq_s)


def _step_args(cfg, step: int) -> dict:
    return dict(
        eps_clip=cfg.ppo.eps_clip,
        use_decoupled_loss=cfg.ppo.use_decoupled_loss,
        behav_imp_weight_cap=cfg.ppo.behav_imp_weight_cap,
        n_minibatches=cfg.ppo.n_minibatches,
        adv_norm=cfg.ppo.adv_norm,
        max_tokens_per_mb=cfg.trainer.mb_spec.max_tokens_per_mb,
        min_n_mbs=cfg.trainer.mb_spec.min_n_mbs,
        seed=cfg.seed + step,  # the same shuffle on every rank
        version=step,  # the trainer's version before step `step` is step
    )
