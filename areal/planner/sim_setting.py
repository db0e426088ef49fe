"""What one simulated run is: the config's knobs that shape its timeline."""

from __future__ import annotations

from dataclasses import dataclass

from areal.config import ExperimentConfig


@dataclass
class Setting:
    """What one simulated run is: the config's knobs that shape its timeline."""

    batch_size: int
    """Groups a training step takes (trainer.batch_size)."""
    group_size: int
    max_staleness: int
    max_concurrent: int = 0
    """Groups in flight at most; 0 = one batch (StalenessGate's rule)."""
    n_minibatches: int = 4
    max_tokens_per_mb: int = 8192
    max_new_tokens: int = 512
    n_servers: int = 1
    max_rows: int = 128
    interruptible: bool = True
    lend: bool = True
    trainer_devices: int = 1
    """GPUs of the trainer (data parallel: token costs divide by it); 1 on a CPU."""
    steps: int = 40
    seed: int = 1
    warm_steps: int | None = None
    """Steps the figures leave out (throughput, staleness, idle); None: the first fifth."""

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, **overrides) -> Setting:
        values = dict(
            batch_size=cfg.trainer.batch_size,
            group_size=cfg.rollout.group_size,
            max_staleness=cfg.max_staleness,
            max_concurrent=cfg.rollout.max_concurrent,
            n_minibatches=cfg.ppo.n_minibatches,
            max_tokens_per_mb=cfg.trainer.mb_spec.max_tokens_per_mb,
            max_new_tokens=cfg.rollout.max_new_tokens,
            n_servers=cfg.rollout.n_servers,
            max_rows=cfg.inference.max_batch_size,
            interruptible=cfg.rollout.interruptible,
            lend=cfg.launcher.lend_idle_cores,
            steps=cfg.total_train_steps,
            seed=cfg.seed,
        )
        values.update(overrides)
        return cls(**values)
