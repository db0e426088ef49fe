"""The trainer's models, built from the config (trainer/worker.py).

    make_backend(cfg, model_dir, dp)  -> the backend trainer.backend names (trainer/backends/)
    make_reference(cfg, dp)           -> the frozen reference policy of ppo.kl_coef
    make_critic(cfg, dp)              -> the value model of ppo.adv_estimator=gae (critic.py)

Each takes its optimizer as one OptimizerSpec (optimizer.py) built from the config here.
The registry imports the backend asked for, lazily: the torch path never imports megatron.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from areal.config import ExperimentConfig
from areal.trainer.backend import TrainerBackend
from areal.trainer.backends import load_backend
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.parallel import DataParallel

if TYPE_CHECKING:
    from areal.trainer.critic import TorchCritic


def make_backend(
    cfg: ExperimentConfig, model_dir: str | Path, dp: DataParallel
) -> tuple[TrainerBackend, DataParallel]:
    """The backend cfg.trainer.backend names, and `dp` narrowed to its data-parallel group
    (megatron: the world is tp * pp * dp ranks, gradients are summed over replicas only)."""
    spec = load_backend(cfg.trainer.backend)
    return spec.build(cfg, model_dir, dp, OptimizerSpec.for_policy(cfg))


def make_reference(cfg: ExperimentConfig, dp: DataParallel) -> TrainerBackend:
    """The frozen reference policy of ppo.kl_coef (ref_model.path, or the policy's initial
    weights): a torch backend whatever trains, used for forwards only (its optimizer never
    steps, so Adam's state is never allocated). With megatron's tensor parallelism each
    rank holds the whole reference model."""
    from areal.trainer.torch_backend import TorchBackend, rank_device

    ref = TorchBackend.from_dir(
        cfg.ref_model.path or cfg.model.path,
        optimizer=OptimizerSpec.for_policy(cfg),
        dtype=cfg.model.dtype,
        temperature=cfg.rollout.temperature,
        device=rank_device(dp),
    )
    ref.model.requires_grad_(False)
    return ref


def make_critic(cfg: ExperimentConfig, dp: DataParallel) -> TorchCritic:
    """The critic of ppo.adv_estimator=gae: a value model on critic.path (or the policy's
    initial weights, also after a resume: the checkpoint then overwrites it), its optimizer
    critic's settings, each null one the trainer's; the warm-up of the trainer's schedule.
    ExperimentConfig refuses it with LoRA and data parallelism, a backend that cannot train
    beside it in its own check."""
    from areal.trainer.critic import TorchCritic
    from areal.trainer.torch_backend import rank_device

    return TorchCritic.from_dir(
        cfg.critic.path or cfg.model.path,
        optimizer=OptimizerSpec.for_critic(cfg),
        dtype=cfg.model.dtype,
        device=rank_device(dp),
    )
