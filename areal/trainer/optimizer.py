"""The optimizer every trained model of a run takes: AdamW, a gradient-norm clip, and a
constant learning rate after a linear warm-up (paper, appendix A).

    trainer.{lr, weight_decay, betas, adam_eps, grad_clip, warmup_steps_ratio}
        --OptimizerSpec.for_policy(trainer, n_updates)--> the policy's backend (and the
                                                          reference's, unused)
    critic.{lr, weight_decay, betas, adam_eps, grad_clip}, each null one the trainer's
        --OptimizerSpec.for_critic(trainer, critic, n_updates)--> the critic (trainer/critic.py)

The settings are read from the config's sections here alone and reach each model as this one
object (areal/worker.py builds them); n_updates is the run's optimizer steps,
total_train_steps * ppo.n_minibatches. Imports no torch: the launcher's summary reads it too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal.config import TrainerConfig
    from areal.trainer.ppo_config import CriticConfig


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """One model's optimizer settings, as the config gives them."""

    lr: float
    """Peak learning rate, reached at the end of the warm-up."""
    weight_decay: float
    """AdamW's decoupled weight decay."""
    betas: tuple[float, float]
    """Adam's (beta1, beta2)."""
    adam_eps: float
    """Adam's epsilon."""
    grad_clip: float
    """Gradient-norm clip, applied before each step."""
    warmup_steps: int
    """Optimizer steps of the linear warm-up (0 or 1: the peak from the first step)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))  # the config's is a list

    @classmethod
    def for_policy(cls, trainer: TrainerConfig, n_updates: int) -> OptimizerSpec:
        """The trainer section's optimizer; its warm-up a fraction of the n_updates optimizer
        steps of the run (one per minibatch)."""
        t = trainer
        return cls(
            lr=t.lr,
            weight_decay=t.weight_decay,
            betas=t.betas,
            adam_eps=t.adam_eps,
            grad_clip=t.grad_clip,
            warmup_steps=int(t.warmup_steps_ratio * n_updates),
        )

    @classmethod
    def for_critic(
        cls, trainer: TrainerConfig, critic: CriticConfig, n_updates: int
    ) -> OptimizerSpec:
        """The critic section's settings, each null one the trainer's; the trainer's warm-up
        (both models step together)."""
        names = ("lr", "weight_decay", "betas", "adam_eps", "grad_clip")
        own = {n: v for n in names if (v := getattr(critic, n)) is not None}
        return replace(cls.for_policy(trainer, n_updates), **own)

    def lr_at(self, n_steps: int) -> float:
        """The learning rate of the step after n_steps optimizer steps."""
        return self.lr * min(1.0, (n_steps + 1) / max(1, self.warmup_steps))

    def adamw_args(self) -> dict[str, Any]:
        """Keyword arguments of torch.optim.AdamW (learning rate: lr_at(0) is set after)."""
        return dict(lr=self.lr, betas=self.betas, eps=self.adam_eps, weight_decay=self.weight_decay)
