"""Every recipe learns: the tiny model, sampling in-process, trained by train_step with the
recipe's objective, raises its reward on a task where the direction is known.

The task: answers of 4 tokens, reward = the share of even token ids in the answer (x 10,
minus 5, so -5 .. +5 as the arithmetic task's). A random model starts near 0; every
objective that follows the gradient of the expected reward must raise it within a few
steps. Samples come from the weights of the previous step (staleness 1), so the decoupled
loss's behaviour weights are not all 1.
"""

from __future__ import annotations

import copy

import pytest
import torch

from areal.models.tiny import build_tiny_model
from areal.trainer.critic import TorchCritic
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.ppo_config import RECIPES, PPOConfig
from areal.trainer.step import train_step
from areal.trainer.torch_backend import TorchBackend
from areal.trajectory import Trajectory

N_PROMPTS, GROUP, N_NEW, STEPS = 4, 8, 4, 20


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(warmup_steps=0)[0]


def make_backend_kwargs(lr: float = 3e-3) -> dict:
    optimizer = OptimizerSpec(
        lr=lr, weight_decay=0.0, betas=(0.9, 0.999), adam_eps=1e-8, grad_clip=1.0, warmup_steps=0
    )
    return dict(optimizer=optimizer, device="cpu")


def make_backend(model, lr: float = 3e-3) -> TorchBackend:
    return TorchBackend(copy.deepcopy(model), **make_backend_kwargs(lr))


@torch.no_grad()
def sample(model, prompts, version: int, gen: torch.Generator, group_base: int):
    """GROUP answers of N_NEW tokens to each prompt, with their log-probs and rewards."""
    trajs = []
    for p, prompt in enumerate(prompts):
        ids = torch.tensor([prompt] * GROUP)
        lps = []
        for _ in range(N_NEW):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), -1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            lps.append(logp.gather(1, tok)[:, 0])
            ids = torch.cat([ids, tok], 1)
        for g in range(GROUP):
            out = ids[g, len(prompt) :].tolist()
            trajs.append(
                Trajectory(
                    group_id=group_base + p,
                    prompt_ids=list(prompt),
                    output_ids=out,
                    logprobs=[float(lp[g]) for lp in lps],
                    versions=[version] * N_NEW,
                    finish_reason="length",
                    reward=10.0 * sum(t % 2 == 0 for t in out) / N_NEW - 5.0,
                )
            )
    return trajs


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_raises_the_reward(model, recipe) -> None:
    torch.manual_seed(0)
    backend = make_backend(model)
    ref = make_backend(model) if RECIPES[recipe].get("kl_coef") else None
    critic = None
    if RECIPES[recipe].get("adv_estimator") == "gae":  # PPO with a critic: a value head
        critic = TorchCritic(copy.deepcopy(model.model), **make_backend_kwargs())
    ppo = PPOConfig(recipe=recipe, n_minibatches=2)
    gen = torch.Generator().manual_seed(1)
    vocab = backend.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (5,), generator=gen).tolist() for _ in range(N_PROMPTS)]
    behaviour = copy.deepcopy(backend.model)  # one version behind the trainer
    rewards = []
    for step in range(STEPS):
        trajs = sample(behaviour, prompts, max(step - 1, 0), gen, step * N_PROMPTS)
        rewards.append(sum(t.reward for t in trajs) / len(trajs))
        behaviour.load_state_dict(backend.model.state_dict())
        stats = train_step(
            backend, trajs, ppo=ppo, max_tokens_per_mb=256, seed=step, version=step,
            ref=ref, max_new_tokens=N_NEW, critic=critic, value_clip=0.2,
        )  # fmt: skip
        assert all(v == v for v in stats.values()), stats  # no NaN
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 1.5, (recipe, [round(r, 2) for r in rewards])
