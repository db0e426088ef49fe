"""The Megatron-Core trainer (areal/trainer/megatron/): a Qwen2 checkpoint as a GPTModel with
tensor, pipeline and data parallelism; the trainer world is tp * pp * dp ranks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from areal.config_loader import ConfigError
from areal.trainer.backends import TrainerBackendSpec

if TYPE_CHECKING:
    from areal.config import ExperimentConfig
    from areal.trainer.megatron.backend import MegatronBackend
    from areal.trainer.optimizer import OptimizerSpec
    from areal.trainer.parallel import DataParallel


class Megatron(TrainerBackendSpec):
    name = "megatron"

    def check(self, cfg: ExperimentConfig) -> None:
        if cfg.ppo.entropy_coef > 0:
            raise ConfigError(
                "ppo.entropy_coef > 0 needs trainer.backend=torch: the megatron backend "
                "computes log-probs of the sampled tokens only (vocab-parallel entropy is "
                "not built); use the torch backend or entropy_coef=0"
            )
        if cfg.model.lora.enabled:
            raise ConfigError(
                "model.lora needs trainer.backend=torch: the megatron backend trains every "
                "weight. LoRA there would take adapter layers on its tensor-parallel linears "
                "(column/row-parallel A and B), their gradients reduced over tp, and an "
                "adapter gathered from the tp ranks at publish; use the torch backend, or "
                "model.lora.rank=0 for full fine-tuning on megatron"
            )
        if cfg.ppo.adv_estimator == "gae":
            raise ConfigError(
                "ppo.adv_estimator=gae (PPO with a critic) is not built with "
                "trainer.backend=megatron: the critic is a torch model beside the policy (a "
                "megatron critic would need its own parallel model, value head and checkpoint "
                "layout); use trainer.backend=torch, or an estimator without a critic "
                "(ppo.recipe=areal, grpo, ...)"
            )

    def build(
        self,
        cfg: ExperimentConfig,
        model_dir: str | Path,
        dp: DataParallel,
        optimizer: OptimizerSpec,
    ) -> tuple[MegatronBackend, DataParallel]:
        from areal.trainer.megatron.backend import MegatronBackend, data_parallel_group

        backend = MegatronBackend(
            model_dir,
            tp=cfg.trainer.parallel.tp,
            pp=cfg.trainer.parallel.pp,
            optimizer=optimizer,
            dtype=cfg.model.dtype,
            save_dtype=cfg.trainer.save_dtype,
            temperature=cfg.rollout.temperature,
            seed=cfg.seed,
        )
        # Gradients are summed over the replicas only: the ranks of one replica hold slices.
        return backend, data_parallel_group(dp)


BACKEND = Megatron()
