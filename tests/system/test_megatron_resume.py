"""Resuming the megatron backend with tensor parallelism (TP=2, gloo, real processes):
2 steps, a checkpoint, 1 more step in new processes = 3 uninterrupted steps, because every
TP rank saved and reloads its own optimizer slice. A different layout is refused.

The checkpoint goes through the trainer worker's own functions (write_trainer_part,
load_trainer_part) and areal.checkpoint's atomic save.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from areal import checkpoint
from areal.comm.net import free_port
from areal.models.tiny import make_tiny_model
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.parallel import init_data_parallel
from areal.trainer.step import train_step
from areal.trainer.worker import load_trainer_part, write_trainer_part
from tests.system.conftest import join_world
from tests.system.test_data_parallel import STEP_ARGS, make_trajectories

OPT = OptimizerSpec(
    lr=1e-2,
    weight_decay=0.0,
    betas=(0.9, 0.999),
    adam_eps=1e-3,
    grad_clip=1.0,
    warmup_steps=3,  # the learning rate still ramps at step 2: n_steps must resume
)
TP = 2


def _step(backend, world, k: int) -> None:
    from areal.trainer.megatron.backend import data_parallel_group

    dp = data_parallel_group(world)
    trajs = make_trajectories(backend.shape.vocab_size)
    train_step(backend, trajs, dp=dp, **{**STEP_ARGS, "seed": k})


def _rank_main(rank: int, phase: str, model_dir: str, exp_dir: str, port: int) -> None:
    """phase "first": steps 0, 1, checkpoint, step 2 -> straight/. "resume": from the
    checkpoint, step 2 -> resumed/."""
    from areal.trainer.megatron.backend import MegatronBackend

    join_world(rank, TP, port)
    exp = Path(exp_dir)
    world = init_data_parallel(1, rank, timeout_s=120, model_parallel=TP)
    try:
        ckpt = checkpoint.latest(exp) if phase == "resume" else None
        backend = MegatronBackend(
            ckpt.model_dir if ckpt else model_dir,
            tp=TP,
            optimizer=OPT,
            save_dtype="float32",
        )
        if phase == "first":
            for k in (0, 1):
                _step(backend, world, k)
            if rank == 0:
                checkpoint.save(exp, 2, lambda d: write_trainer_part(backend, d))
            else:
                write_trainer_part(backend, None)
        else:
            load_trainer_part(backend, ckpt.path)
        _step(backend, world, 2)
        out = exp / ("straight" if phase == "first" else "resumed")
        backend.save_hf(out if rank == 0 else None)
    finally:
        world.close()


def test_tp2_resume_equals_uninterrupted_training(tmp_path):
    model_dir = make_tiny_model(tmp_path / "model", warmup_steps=0)
    for phase in ("first", "resume"):
        mp.spawn(_rank_main, args=(phase, str(model_dir), str(tmp_path), free_port()), nprocs=TP)
    ckpt = checkpoint.latest(tmp_path)
    assert ckpt.version == 2
    names = sorted(p.name for p in ckpt.path.iterdir())
    for t in range(TP):
        assert f"optimizer-tp{t}-pp0.safetensors" in names and f"optimizer-tp{t}-pp0.json" in names
    straight = load_file(tmp_path / "straight/model.safetensors")
    resumed = load_file(tmp_path / "resumed/model.safetensors")
    start = load_file(model_dir / "model.safetensors")
    assert sorted(resumed) == sorted(straight)
    for k in straight:
        assert not torch.equal(straight[k], start[k]), k
        assert torch.equal(resumed[k], straight[k]), k  # bit-exact


def test_resuming_with_another_layout_is_refused():
    from areal.trainer.megatron.backend import MegatronBackend

    run = SimpleNamespace(tp=1, pp=2)
    with pytest.raises(ValueError, match=r"saved with trainer.parallel.tp=2, pp=1 .* tp=1, pp=2"):
        MegatronBackend.load_state_dict(run, {"n_steps": 2, "tp": 2, "pp": 1})
