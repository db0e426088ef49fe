"""The trainer backend trainer.backend names, built from the config (trainer/worker.py).

    make_backend(cfg, model_dir, dp)  -> TorchBackend (torch_backend.py) | MegatronBackend
    make_reference(cfg, dp)           -> the frozen reference policy of ppo.kl_coef
    make_critic(cfg, dp)              -> the value model of ppo.adv_estimator=gae (critic.py)

The seam (backend.py) imports no backend; this module imports the one asked for, lazily:
the torch path never imports megatron.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from areal.config import ExperimentConfig
from areal.trainer.backend import TrainerBackend
from areal.trainer.parallel import DataParallel

if TYPE_CHECKING:
    from areal.lora import LoRASpec
    from areal.trainer.critic import TorchCritic


def _backend_kwargs(cfg: ExperimentConfig) -> dict:
    """What every backend takes from the config: the optimizer, its schedule, the dtype."""
    t = cfg.trainer
    n_updates = cfg.total_train_steps * cfg.ppo.n_minibatches
    return dict(
        lr=t.lr,
        weight_decay=t.weight_decay,
        betas=t.betas,
        adam_eps=t.adam_eps,
        grad_clip=t.grad_clip,
        warmup_steps=int(t.warmup_steps_ratio * n_updates),
        dtype=cfg.model.dtype,
        temperature=cfg.rollout.temperature,
    )


def lora_spec(cfg: ExperimentConfig) -> LoRASpec | None:
    """model.lora as the trainer's LoRASpec, or None for full fine-tuning."""
    lora = cfg.model.lora
    if not lora.enabled:
        return None
    from areal.lora import LoRASpec

    return LoRASpec(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules))


def make_backend(
    cfg: ExperimentConfig, model_dir: str | Path, dp: DataParallel
) -> tuple[TrainerBackend, DataParallel]:
    """The backend cfg.trainer.backend names, and `dp` narrowed to its data-parallel group
    (megatron: the world is tp * pp * dp ranks, gradients are summed over replicas only)."""
    t = cfg.trainer
    common = _backend_kwargs(cfg)
    if t.backend == "torch":
        from areal.trainer.torch_backend import TorchBackend

        device = str(dp.device) if dp.device.type == "cuda" else None
        lora = lora_spec(cfg)
        if lora:
            # The base is always model.path; a resumed run's model_dir is its adapter.
            from areal.lora import is_adapter_dir

            adapter = model_dir if is_adapter_dir(model_dir) else None
            backend = TorchBackend.from_dir(
                cfg.model.path, device=device, lora=lora, adapter_dir=adapter, **common
            )
            return backend, dp
        return TorchBackend.from_dir(model_dir, device=device, **common), dp
    # ExperimentConfig refuses model.lora with megatron (it says what LoRA would take there).
    assert t.backend == "megatron", t.backend  # TrainerConfig checks the name
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


def make_reference(cfg: ExperimentConfig, dp: DataParallel) -> TrainerBackend:
    """The frozen reference policy of ppo.kl_coef (ref_model.path, or the policy's initial
    weights): a torch backend whatever trains, used for forwards only (its optimizer never
    steps, so Adam's state is never allocated). With megatron's tensor parallelism each
    rank holds the whole reference model."""
    from areal.trainer.torch_backend import TorchBackend

    device = str(dp.device) if dp.device.type == "cuda" else None
    ref = TorchBackend.from_dir(
        cfg.ref_model.path or cfg.model.path, device=device, **_backend_kwargs(cfg)
    )
    ref.model.requires_grad_(False)
    return ref


def make_critic(cfg: ExperimentConfig, dp: DataParallel) -> TorchCritic:
    """The critic of ppo.adv_estimator=gae: a value model on critic.path (or the policy's
    initial weights, also after a resume: the checkpoint then overwrites it), its optimizer
    critic's settings, each null one the trainer's; the warm-up of the trainer's schedule.
    ExperimentConfig refuses it with megatron, LoRA and data parallelism."""
    from areal.trainer.critic import TorchCritic

    device = str(dp.device) if dp.device.type == "cuda" else None
    common = _backend_kwargs(cfg)
    return TorchCritic.from_dir(
        cfg.critic.path or cfg.model.path,
        **cfg.critic.optimizer(cfg.trainer),
        warmup_steps=common["warmup_steps"],
        dtype=common["dtype"],
        device=device,
    )
