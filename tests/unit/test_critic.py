"""PPO with a critic: GAE and the clipped value loss against loop-per-token references
written from their papers (float64, values and gradients), the config's refusals, the
critic's checkpoint round trip, and train_step with a critic on the tiny model."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from areal.checkpoint import save as save_checkpoint
from areal.config import ConfigError, load_config
from areal.models.tiny import make_tiny_model
from areal.trainer.critic import TorchCritic
from areal.trainer.optimizer import OptimizerSpec
from areal.trainer.ppo import ADV_EPS, gae, gae_advantages, token_rewards, value_loss
from areal.trainer.ppo_config import PPOConfig
from areal.trainer.step import train_step
from areal.trainer.torch_backend import TorchBackend
from areal.trainer.worker import load_trainer_part, write_trainer_part
from areal.trajectory import Trajectory

F64 = torch.float64


# ---------------------------------------------------------------- references from the papers


def reference_gae(
    rewards: list[float], values: list[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Schulman et al. 2016, eq. 16, over one episode's steps 0..T-1, token by token:
    delta_t = r_t + gamma V(s_{t+1}) - V(s_t), V(s_T) = 0 (terminal);
    A_t = sum_{l >= 0} (gamma lam)^l delta_{t+l}; returns R_t = A_t + V(s_t)."""
    n = len(rewards)
    deltas = [
        rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)
    ]
    advs = [sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t)) for t in range(n)]
    return advs, [a + v for a, v in zip(advs, values, strict=True)]


def reference_value_loss(values, old, returns, eps) -> torch.Tensor:
    """PPO's clipped value loss (as OpenRLHF's ValueLoss and verl's compute_value_loss), token
    by token, averaged over the tokens."""
    terms = []
    for v, o, r in zip(values, old, returns, strict=True):
        if eps is None:
            terms.append(0.5 * (v - r) ** 2)
            continue
        v_clipped = o + torch.clamp(v - o, -eps, eps)
        terms.append(0.5 * torch.maximum((v - r) ** 2, (v_clipped - r) ** 2))
    return torch.stack(terms).sum() / len(terms)


def random_sequences(seed: int, n: int = 5):
    """Per-sequence streams: a prompt part (mask 0), generated tokens with a gap of
    not-generated tokens (a tool's output) in some, values and per-token KL."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    masks, values, kls = [], [], []
    for i in range(n):
        n_prompt, n_out = rng.randint(1, 4), rng.randint(1, 9)
        mask = torch.cat([torch.zeros(n_prompt), torch.ones(n_out)])
        if n_out > 3 and i % 2:
            mask[n_prompt + 1 : n_prompt + 3] = 0  # the environment's tokens
        masks.append(mask)
        values.append(torch.randn(len(mask), generator=gen, dtype=F64))
        kls.append(torch.rand(len(mask), generator=gen, dtype=F64))
    rewards = torch.tensor([rng.choice([5.0, -5.0, 1.5]) for _ in range(n)], dtype=F64)
    return rewards, masks, values, kls


# ---------------------------------------------------------------- GAE


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
@pytest.mark.parametrize("kl_in", ["loss", "reward"])
def test_gae_equals_the_papers_sum_token_by_token(gamma, lam, kl_in) -> None:
    rewards, masks, values, kls = random_sequences(0)
    cfg = PPOConfig(recipe="ppo", gamma=gamma, lam=lam, kl_coef=0.1, kl_in=kl_in)
    per_token = token_rewards(rewards, masks, cfg, kls)
    values = [v.clone().requires_grad_(True) for v in values]
    advs, returns = gae(per_token, values, masks, gamma, lam)
    for i, mask in enumerate(masks):
        on = mask.bool()
        # The episode: the generated tokens in order; r at the last one, less the KL.
        r = [-0.1 * float(k) if kl_in == "reward" else 0.0 for k in kls[i][on]]
        r[-1] += float(rewards[i])
        ref_a, ref_r = reference_gae(r, values[i][on].tolist(), gamma, lam)
        assert advs[i][on].tolist() == pytest.approx(ref_a, abs=1e-10)
        assert returns[i][on].tolist() == pytest.approx(ref_r, abs=1e-10)
        assert not advs[i][~on].any() and not returns[i][~on].any()
    # Gradients with respect to the values: the reference's, by autograd on its loop.
    w = [torch.randn(len(m), generator=torch.Generator().manual_seed(i), dtype=F64)
         for i, m in enumerate(masks)]  # fmt: skip
    torch.autograd.backward(sum((a * wi).sum() for a, wi in zip(advs, w, strict=True)))
    for i, mask in enumerate(masks):
        on = mask.bool()
        v = values[i].detach()[on].clone().requires_grad_(True)
        n = len(v)
        r = [float(x) for x in per_token[i][on]]
        deltas = [r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
        a = [sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t)) for t in range(n)]
        (grad,) = torch.autograd.grad((torch.stack(a) * w[i][on]).sum(), v)
        assert torch.allclose(values[i].grad[on], grad, atol=1e-10)
        assert not values[i].grad[~on].any()


def test_gae_with_lambda_one_is_the_return_less_the_value() -> None:
    rewards, masks, values, _ = random_sequences(1)
    advs, returns = gae(token_rewards(rewards, masks, PPOConfig()), values, masks, 1.0, 1.0)
    for i, mask in enumerate(masks):
        on = mask.bool()
        assert torch.allclose(
            returns[i][on], torch.full((int(on.sum()),), rewards[i].item(), dtype=F64)
        )  # noqa: E501
        assert torch.allclose(advs[i][on], rewards[i] - values[i][on])


@pytest.mark.parametrize("adv_norm, std", [("batch", True), ("batch", False), ("none", True)])
def test_gae_advantages_whitened_over_every_generated_token(adv_norm, std) -> None:
    rewards, masks, values, _ = random_sequences(2)
    cfg = PPOConfig(recipe="ppo", adv_norm=adv_norm, adv_std_norm=std, mask_truncated=True)
    truncated = torch.tensor([False, True, False, False, False])
    advs, returns = gae_advantages(rewards, masks, values, cfg, truncated=truncated)
    raw, raw_returns = gae(token_rewards(rewards, masks, cfg), values, masks, 1.0, 0.95)
    flat = torch.cat([a[m.bool()] for a, m in zip(raw, masks, strict=True)])
    mean, sd = flat.mean(), flat.std(unbiased=False)
    for i, mask in enumerate(masks):
        on = mask.bool()
        want = raw[i][on]
        if adv_norm == "batch":
            want = (want - mean) / (sd + ADV_EPS) if std else want - mean
        if truncated[i]:
            want = torch.zeros_like(want)
        assert torch.allclose(advs[i][on].double(), want, atol=1e-5)
        assert torch.equal(returns[i], raw_returns[i])  # truncated samples' too
    # Two ranks holding two halves, whitening over both (sum_over_ranks): the same result.
    halves = [slice(0, 2), slice(2, 5)]
    barrier, slots = threading.Barrier(2), [None, None]
    results = [None, None]

    def rank(k: int) -> None:
        def total(xs):
            slots[k] = xs
            barrier.wait()
            out = [a + b for a, b in zip(*slots, strict=True)]
            barrier.wait()
            return out

        h = halves[k]
        results[k] = gae_advantages(
            rewards[h], masks[h], values[h], cfg, truncated=truncated[h], sum_over_ranks=total
        )[0]

    threads = [threading.Thread(target=rank, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(results[0] + results[1], advs, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


# ---------------------------------------------------------------- the value loss


@pytest.mark.parametrize("eps", [0.2, 0.5, None])
def test_value_loss_equals_the_clipped_loss_token_by_token(eps) -> None:
    gen = torch.Generator().manual_seed(3)
    n = 40
    mask = (torch.rand(n, generator=gen) > 0.3).double()
    old = torch.randn(n, generator=gen, dtype=F64)
    values = (old + 0.6 * torch.randn(n, generator=gen, dtype=F64)).requires_grad_(True)
    returns = torch.randn(n, generator=gen, dtype=F64) * 2
    loss, stats = value_loss(values, old, returns, mask, eps, n_norm=int(mask.sum()) + 3)
    on = mask.bool()
    v_ref = values.detach()[on].clone().requires_grad_(True)
    ref = reference_value_loss(v_ref, old[on], returns[on], eps) * on.sum() / (on.sum() + 3)
    assert abs(loss.item() - ref.item()) < 1e-12
    loss.backward()
    ref.backward()
    assert torch.allclose(values.grad[on], v_ref.grad, atol=1e-12)
    assert not values.grad[~on].any()
    if eps is not None:
        clipped = [
            (o + max(-eps, min(eps, v - o)) - r) ** 2 > (v - r) ** 2
            for v, o, r in zip(
                values[on].tolist(), old[on].tolist(), returns[on].tolist(), strict=True
            )  # noqa: E501
        ]
        assert stats["critic/clipfrac"] == pytest.approx(sum(clipped) / len(clipped))
        assert 0 < stats["critic/clipfrac"] < 1
    else:
        assert stats["critic/clipfrac"] == 0


# ---------------------------------------------------------------- the config


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["ppo.recipe=ppo", "trainer.backend=megatron"], ["trainer.backend=megatron", "torch"]),
        (["ppo.recipe=ppo", "model.lora.rank=4"], ["model.lora", "model.lora.rank=0"]),
        (
            ["ppo.recipe=ppo", "trainer.parallel.dp=2"],
            ["trainer.parallel.dp > 1", "trainer.parallel.dp=1"],
        ),
        (
            ["ppo.recipe=ppo", "trainer.backend=megatron", "trainer.parallel.tp=2"],
            ["trainer.backend=megatron"],
        ),
        (["ppo.gamma=0.99"], ["ppo.gamma is GAE's", "adv_estimator=gae"]),
        (["ppo.recipe=grpo", "ppo.lam=0.9"], ["ppo.lam is GAE's"]),
        (["ppo.recipe=ppo", "ppo.lam=1.5"], ["ppo.lam must be in [0, 1]"]),
        (["ppo.recipe=ppo", "ppo.adv_norm=group"], ["ppo.adv_norm must be one of batch, none"]),
        (["critic.value_clip=0"], ["critic.value_clip must be > 0"]),
        (["critic.betas=[0.9]"], ["critic.betas must be two numbers"]),
    ],
)
def test_critic_config_mistakes_are_explained(overrides, words) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for w in words:
        assert w in str(info.value)


def test_ppo_recipe_turns_the_critic_on_with_the_trainers_optimizer_by_default() -> None:
    cfg = load_config(None, ["ppo.recipe=ppo", "trainer.lr=3e-4", "critic.lr=1e-3"])
    assert (cfg.ppo.adv_estimator, cfg.ppo.gamma, cfg.ppo.lam) == ("gae", 1.0, 0.95)
    assert (cfg.ppo.adv_norm, cfg.ppo.adv_std_norm) == ("batch", True)
    assert "adv=gae[gamma=1, lam=0.95, batch]" in cfg.ppo.summary()
    n_updates = cfg.total_train_steps * cfg.ppo.n_minibatches
    opt = OptimizerSpec.for_critic(cfg.trainer, cfg.critic, n_updates)
    policy = OptimizerSpec.for_policy(cfg.trainer, n_updates)
    assert opt.lr == 1e-3 and opt.betas == tuple(cfg.trainer.betas) == policy.betas
    assert (opt.grad_clip, opt.warmup_steps) == (policy.grad_clip, policy.warmup_steps)
    default = load_config(None, [])
    assert (default.ppo.gamma, default.ppo.lam) == (None, None)  # no critic by default


# ---------------------------------------------------------------- the critic on the tiny model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", warmup_steps=0)


OPT = dict(
    optimizer=OptimizerSpec(
        lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), adam_eps=1e-3, grad_clip=1e9,
        warmup_steps=0,
    ),
    device="cpu",
)  # fmt: skip


class CountingCritic(TorchCritic):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards: list[tuple[int, bool]] = []  # (sequences, with gradients)
        self.steps = 0

    def values(self, seqs, starts=None):
        self.forwards.append((len(seqs), torch.is_grad_enabled()))
        return super().values(seqs, starts)

    def optimizer_step(self):
        self.steps += 1
        return super().optimizer_step()


@pytest.fixture(scope="module")
def trajectories(model_dir):
    rng = random.Random(0)
    vocab = TorchBackend.from_dir(model_dir, **OPT).model.config.vocab_size
    trajs = []
    for k in range(8):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(2, 9))]
        trajs.append(
            Trajectory(
                group_id=k // 2,
                prompt_ids=prompt,
                output_ids=output,
                logprobs=[-3.0] * len(output),
                versions=[0] * len(output),
                reward=rng.choice([5.0, -5.0]),
            )  # fmt: skip
        )
    return trajs


def test_the_critic_starts_from_the_policys_trunk_and_a_zero_head(model_dir) -> None:
    critic = TorchCritic.from_dir(model_dir, **OPT)
    policy = TorchBackend.from_dir(model_dir, **OPT).model.model  # the causal LM's trunk
    trunk = dict(critic.model.trunk.named_parameters())
    assert len(trunk) == len(list(policy.parameters())) > 0
    for name, p in policy.named_parameters():
        assert torch.equal(trunk[name], p), name
    assert not critic.model.head.weight.any() and not critic.model.head.bias.any()


def test_value_stream_of_a_packed_micro_batch_equals_each_sequence_alone(
    model_dir, trajectories
) -> None:
    critic = TorchCritic.from_dir(model_dir, **OPT)
    torch.nn.init.normal_(critic.model.head.weight)  # not zero: values that differ
    seqs = [t.prompt_ids + t.output_ids for t in trajectories]
    starts = [t.n_prompt - 1 for t in trajectories]
    with torch.no_grad():
        packed = critic.values(seqs, starts)
        trunk = critic.model.trunk
        alone = []
        for seq, start in zip(seqs, starts, strict=True):
            hidden = trunk(input_ids=torch.tensor([seq])).last_hidden_state[0]
            v = critic.model.head(hidden)[:-1, 0]
            v[:start] = 0
            alone.append(v)
    assert torch.allclose(packed, torch.cat(alone), atol=1e-5)


def test_train_step_with_a_critic(model_dir, trajectories) -> None:
    """One extra forward and backward per minibatch: the value pass over the batch, then
    per minibatch one forward with gradients and one optimizer step; the values move
    towards the returns and every statistic is finite."""
    backend = TorchBackend.from_dir(model_dir, **OPT)
    critic = CountingCritic.from_dir(model_dir, **OPT)
    ppo = PPOConfig(recipe="ppo", n_minibatches=2)
    with pytest.raises(ValueError, match="go together"):
        train_step(backend, trajectories, ppo=ppo, max_tokens_per_mb=512)
    losses = []
    for step in range(3):
        critic.forwards.clear()
        stats = train_step(
            backend, trajectories, ppo=ppo, max_tokens_per_mb=512, critic=critic,
            value_clip=0.2, seed=step,
        )  # fmt: skip
        assert critic.forwards == [(8, False), (4, True), (4, True)]  # one micro-batch each
        losses.append(stats["critic/value_loss"])
        for key in ("critic/values_mean", "critic/returns_mean", "critic/explained_var",
                    "critic/clipfrac", "critic/grad_norm"):  # fmt: skip
            assert stats[key] == stats[key] and abs(stats[key]) < 1e3, (key, stats)
    assert critic.steps == 6
    assert losses[-1] < losses[0]
    # The first step's values are the zero head's: the returns are the lambda-returns of
    # rewards at the last token, and the clip fraction 0 (V = V_old on the first update).
    critic2 = CountingCritic.from_dir(model_dir, **OPT)
    first = train_step(
        TorchBackend.from_dir(model_dir, **OPT), trajectories, ppo=ppo, max_tokens_per_mb=512,
        critic=critic2, value_clip=0.2,
    )  # fmt: skip
    assert first["critic/values_mean"] == 0.0 and first["critic/explained_var"] == 0.0


def _critic_step(critic: TorchCritic, k: int, seqs) -> None:
    def loss_fn(i, values):
        return ((values - (k + 1)) ** 2).mean(), {}

    critic.forward_backward([seqs[:2], seqs[2:]], loss_fn, [[1, 0], [2, 1]])
    critic.optimizer_step()


def test_critic_survives_a_checkpoint(model_dir, trajectories, tmp_path) -> None:
    """2 steps, a checkpoint, 1 step from it = 3 uninterrupted steps, bit for bit (weights,
    head and Adam's state); a checkpoint without a critic is refused clearly."""
    seqs = [t.prompt_ids + t.output_ids for t in trajectories[:4]]
    backend = TorchBackend.from_dir(model_dir, **OPT)
    straight = TorchCritic.from_dir(model_dir, **OPT)
    for k in (0, 1):
        _critic_step(straight, k, seqs)
    ckpt = save_checkpoint(tmp_path, 2, lambda d: write_trainer_part(backend, d, straight))
    assert (ckpt.path / "critic.safetensors").exists()
    _critic_step(straight, 2, seqs)

    resumed = TorchCritic.from_dir(model_dir, **OPT)
    load_trainer_part(TorchBackend.from_dir(ckpt.model_dir, **OPT), ckpt.path, resumed)
    assert resumed.n_steps == 2
    _critic_step(resumed, 2, seqs)
    for (name, p), r in zip(
        straight.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(p, r), name
    assert resumed.model.head.weight.abs().sum() > 0

    bare = save_checkpoint(tmp_path / "bare", 2, lambda d: write_trainer_part(backend, d))
    with pytest.raises(ValueError, match="holds no critic"):
        load_trainer_part(backend, bare.path, TorchCritic.from_dir(model_dir, **OPT))
