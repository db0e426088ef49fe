"""The console says at start what is on beyond the paper's default (areal/train.py)."""

from __future__ import annotations

from areal.config import load_config
from areal.train import setup_lines


def lines(*overrides: str) -> list[str]:
    return setup_lines(load_config("configs/tiny.yaml", list(overrides)))


def test_the_default_is_one_objective_line():
    (only,) = lines()
    assert only.startswith("objective recipe=areal decoupled") and "not the paper's" not in only


def test_lora_a_reference_model_and_another_objective_are_said():
    assert lines("model.lora.rank=16")[1].startswith("LoRA on: rank 16, alpha 32 on all-linear")
    grpo = lines("ppo.recipe=grpo")
    assert grpo[0].endswith("(not the paper's default decoupled PPO)")
    assert grpo[1] == "reference model on: the policy's initial weights (ppo.kl_coef=0.04)"
    assert lines("ppo.eps_clip=0.1")[0].endswith("(not the paper's default decoupled PPO)")
