"""The plain-torch trainer (areal/trainer/torch_backend.py): a transformers causal LM, every
rank the whole model, data parallelism only; the one that trains LoRA adapters."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from areal.config_loader import ConfigError
from areal.trainer.backends import TrainerBackendSpec

if TYPE_CHECKING:
    from areal.config import ExperimentConfig
    from areal.lora import LoRASpec
    from areal.trainer.optimizer import OptimizerSpec
    from areal.trainer.parallel import DataParallel
    from areal.trainer.torch_backend import TorchBackend


class Torch(TrainerBackendSpec):
    name = "torch"
    in_process = True  # one rank needs no process group (areal/inline.py)

    def check(self, cfg: ExperimentConfig) -> None:
        par = cfg.trainer.parallel
        if par.tp * par.pp > 1:
            raise ConfigError(
                f"trainer.parallel.tp={par.tp}, pp={par.pp} need trainer.backend=megatron: "
                "the torch backend is data-parallel only"
            )

    def build(
        self,
        cfg: ExperimentConfig,
        model_dir: str | Path,
        dp: DataParallel,
        optimizer: OptimizerSpec,
    ) -> tuple[TorchBackend, DataParallel]:
        from areal.trainer.torch_backend import TorchBackend, rank_device
        from areal.weights import is_adapter_dir

        lora = lora_spec(cfg)
        # A LoRA run's base is always model.path; a resumed one's model_dir is its adapter.
        adapter = model_dir if lora and is_adapter_dir(model_dir) else None
        backend = TorchBackend.from_dir(
            cfg.model.path if lora else model_dir,
            optimizer=optimizer,
            dtype=cfg.model.dtype,
            temperature=cfg.rollout.temperature,
            device=rank_device(dp),
            lora=lora,
            adapter_dir=adapter,
        )
        return backend, dp


def lora_spec(cfg: ExperimentConfig) -> LoRASpec | None:
    """model.lora as the trainer's LoRASpec, or None for full fine-tuning."""
    lora = cfg.model.lora
    if not lora.enabled:
        return None
    from areal.lora import LoRASpec

    return LoRASpec(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules))


BACKEND = Torch()
