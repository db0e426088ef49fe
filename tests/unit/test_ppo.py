"""Decoupled PPO loss (paper section 5.2) and advantages, against hand-computed values.

Inputs are written in terms of the two ratios of the objective, u = pi_theta / pi_prox and
w = pi_prox / pi_behav, so every expected value below is arithmetic on u, w and A:

    loss = -sum_valid w * min(u * A, clip(u, 1 - eps, 1 + eps) * A) / n
"""

from __future__ import annotations

import math

import pytest
import torch

from areal.trainer.ppo import behaviour_weight_mask, compute_advantages, decoupled_ppo_loss

PROX = -1.3  # an arbitrary proximal log-prob; only differences of log-probs matter


def make_inputs(u, adv, w=None, mask=None):
    """Tensors with ratio u = exp(logprobs - prox) and behaviour weight w = exp(prox - behav)."""
    n = len(u)
    w = [1.0] * n if w is None else w
    mask = [1.0] * n if mask is None else mask
    prox = torch.full((n,), PROX, dtype=torch.float64)
    logprobs = (prox + torch.log(torch.tensor(u, dtype=torch.float64))).requires_grad_(True)
    behav = prox - torch.log(torch.tensor(w, dtype=torch.float64))
    return logprobs, prox, behav, torch.tensor(adv, dtype=torch.float64), torch.tensor(mask)


def loss_of(u, adv, w=None, mask=None, **kw):
    return decoupled_ppo_loss(*make_inputs(u, adv, w, mask), **kw)


# ---------------------------------------------------------------- the objective's value


def test_unclipped_tokens_with_positive_and_negative_advantages() -> None:
    loss, stats = loss_of([1.1, 0.9], [2.0, -1.0])
    # token 0: min(1.1*2, 1.1*2) = 2.2; token 1: min(0.9*-1, 0.9*-1) = -0.9
    # loss = -(2.2 - 0.9) / 2 = -0.65
    assert loss.item() == pytest.approx(-0.65, abs=1e-9)
    assert stats["loss/clipfrac"] == 0.0
    assert stats["loss/n_valid_tokens"] == 2


def test_clipped_above_with_positive_advantage_takes_clipped_branch() -> None:
    loss, stats = loss_of([1.5], [2.0], eps_clip=0.2)
    # min(1.5*2 = 3.0, 1.2*2 = 2.4) = 2.4  ->  loss = -2.4
    assert loss.item() == pytest.approx(-2.4, abs=1e-9)
    assert stats["loss/clipfrac"] == 1.0


def test_clipped_below_with_negative_advantage_takes_clipped_branch() -> None:
    loss, stats = loss_of([0.5], [-1.0], eps_clip=0.2)
    # min(0.5*-1 = -0.5, 0.8*-1 = -0.8) = -0.8  ->  loss = 0.8
    assert loss.item() == pytest.approx(0.8, abs=1e-9)
    assert stats["loss/clipfrac"] == 1.0


def test_ratio_above_range_with_negative_advantage_is_not_clipped() -> None:
    loss, stats = loss_of([1.5], [-1.0], eps_clip=0.2)
    # min(1.5*-1 = -1.5, 1.2*-1 = -1.2) = -1.5: the pessimistic, unclipped term  ->  loss = 1.5
    assert loss.item() == pytest.approx(1.5, abs=1e-9)
    assert stats["loss/clipfrac"] == 0.0


def test_ratio_below_range_with_positive_advantage_is_not_clipped() -> None:
    loss, stats = loss_of([0.5], [1.0], eps_clip=0.2)
    # min(0.5*1 = 0.5, 0.8*1 = 0.8) = 0.5  ->  loss = -0.5
    assert loss.item() == pytest.approx(-0.5, abs=1e-9)
    assert stats["loss/clipfrac"] == 0.0


def test_eps_clip_sets_the_trust_region_width() -> None:
    loss, _ = loss_of([1.5], [2.0], eps_clip=0.3)
    # min(1.5*2 = 3.0, 1.3*2 = 2.6) = 2.6  ->  loss = -2.6
    assert loss.item() == pytest.approx(-2.6, abs=1e-9)


def test_mixed_clipped_and_unclipped_tokens_average_over_valid_tokens() -> None:
    loss, stats = loss_of([1.5, 0.5, 1.5, 0.5], [2.0, -1.0, -1.0, 1.0])
    # objectives 2.4, -0.8, -1.5, 0.5 (see the single-token tests); sum = 0.6
    # loss = -0.6 / 4 = -0.15; clipped: the first two -> clipfrac = 2/4
    assert loss.item() == pytest.approx(-0.15, abs=1e-9)
    assert stats["loss/clipfrac"] == pytest.approx(0.5)


def test_behaviour_weight_multiplies_the_objective() -> None:
    loss, stats = loss_of([1.1, 1.5], [1.0, 2.0], w=[2.0, 0.5])
    # token 0: 2 * min(1.1, 1.1) = 2.2; token 1: 0.5 * min(3.0, 2.4) = 1.2
    # loss = -(2.2 + 1.2) / 2 = -1.7
    assert loss.item() == pytest.approx(-1.7, abs=1e-9)
    assert stats["loss/behav_weight_mean"] == pytest.approx(1.25)  # (2 + 0.5) / 2
    assert stats["loss/behav_weight_max"] == pytest.approx(2.0)


def test_clipping_is_centred_on_the_proximal_not_the_behaviour_policy() -> None:
    # pi_theta / pi_behav = 1.1 * 4 = 4.4, far outside [0.8, 1.2], but u = 1.1 is inside:
    # the token is not clipped. objective = 4 * 1.1 * 1 = 4.4  ->  loss = -4.4
    loss, stats = loss_of([1.1], [1.0], w=[4.0])
    assert loss.item() == pytest.approx(-4.4, abs=1e-9)
    assert stats["loss/clipfrac"] == 0.0


def test_naive_ppo_prox_equal_behav_gives_weight_one() -> None:
    logprobs = torch.tensor([-0.5, -2.0, -1.0])
    behav = torch.tensor([-0.7, -1.5, -1.0])
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, stats = decoupled_ppo_loss(logprobs, behav, behav, adv, torch.ones(3))
    assert stats["loss/behav_weight_mean"] == 1.0
    assert stats["loss/behav_weight_max"] == 1.0
    # plain PPO-clip with u = exp(logprobs - behav): exp(0.2), exp(-0.5), exp(0)
    u = [math.exp(0.2), math.exp(-0.5), 1.0]  # 1.2214, 0.6065, 1.0
    # token 0: min(1.2214, 1.2) = 1.2; token 1: min(-0.6065, -0.8) = -0.8; token 2: 2.0
    assert u[0] > 1.2 and u[1] < 0.8
    assert loss.item() == pytest.approx(-(1.2 - 0.8 + 2.0) / 3, abs=1e-6)  # -0.8


# ---------------------------------------------------------------- which tokens count


def test_masked_tokens_contribute_nothing() -> None:
    loss, stats = loss_of([1.1, 3.0, 0.9], [1.0, 5.0, 1.0], w=[1.0, 3.0, 1.0], mask=[1, 0, 1])
    # valid: 1.1 * 1 + 0.9 * 1 = 2.0 over 2 tokens  ->  loss = -1.0
    assert loss.item() == pytest.approx(-1.0, abs=1e-9)
    assert stats["loss/n_valid_tokens"] == 2
    assert stats["loss/n_capped_tokens"] == 0
    assert stats["loss/behav_weight_max"] == pytest.approx(1.0)  # the masked 3.0 is ignored
    # changing anything on the masked token changes nothing
    other, _ = loss_of([1.1, 0.2, 0.9], [1.0, -7.0, 1.0], w=[1.0, 0.1, 1.0], mask=[1, 0, 1])
    assert other.item() == loss.item()


def test_all_tokens_masked_gives_zero_loss_not_nan() -> None:
    loss, stats = loss_of([1.1, 0.9], [1.0, -1.0], mask=[0, 0])
    assert loss.item() == 0.0
    assert stats["loss/n_valid_tokens"] == 0
    assert stats["loss/behav_weight_max"] == 0.0
    assert all(math.isfinite(v) for v in stats.values())


def test_cap_excludes_tokens_from_numerator_and_default_denominator() -> None:
    u, adv, w = [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 10.0, 2.0]
    capped, stats = loss_of(u, adv, w=w, behav_imp_weight_cap=5.0)
    # weight 10 > 5 is dropped: (1*1 + 2*1) / 2 = 1.5  ->  loss = -1.5
    assert capped.item() == pytest.approx(-1.5, abs=1e-9)
    assert stats["loss/n_valid_tokens"] == 2
    assert stats["loss/n_capped_tokens"] == 1
    assert stats["loss/behav_weight_mean"] == pytest.approx(1.5)  # (1 + 2) / 2
    assert stats["loss/behav_weight_max"] == pytest.approx(2.0)
    uncapped, stats = loss_of(u, adv, w=w)
    # (1 + 10 + 2) / 3 = 13/3  ->  loss = -4.3333
    assert uncapped.item() == pytest.approx(-13 / 3, abs=1e-9)
    assert stats["loss/n_capped_tokens"] == 0


def test_cap_keeps_a_weight_equal_to_the_cap() -> None:
    # prox == behav gives weight exactly exp(0) = 1.0, which is not above a cap of 1.0
    loss, stats = loss_of([1.1, 1.1], [1.0, 1.0], w=[1.0, 2.0], behav_imp_weight_cap=1.0)
    # only token 0: 1 * 1.1  ->  loss = -1.1
    assert loss.item() == pytest.approx(-1.1, abs=1e-9)
    assert stats["loss/n_valid_tokens"] == 1


def test_cap_does_not_count_masked_tokens_as_capped() -> None:
    _, stats = loss_of([1.0, 1.0], [1.0, 1.0], w=[9.0, 9.0], mask=[1, 0], behav_imp_weight_cap=5.0)
    assert stats["loss/n_capped_tokens"] == 1
    assert stats["loss/n_valid_tokens"] == 0


def test_behaviour_weight_mask_matches_the_loss_selection() -> None:
    prox = torch.tensor([0.0, 0.0, 0.0, 0.0])
    behav = torch.log(torch.tensor([1.0, 0.1, 0.5, 0.1]))  # weights 1, 10, 2, 10
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert behaviour_weight_mask(prox, behav, mask, 5.0).tolist() == [True, False, True, False]
    assert behaviour_weight_mask(prox, behav, mask, None).tolist() == [True, True, True, False]


def test_cap_excludes_a_token_whose_weight_overflows() -> None:
    logprobs = torch.tensor([-1.0, -1.0], requires_grad=True)
    prox = torch.tensor([-1.0, -1.0])
    behav = torch.tensor([-1.0, -200.0])  # weight exp(199) = inf in float32: far above cap
    loss, stats = decoupled_ppo_loss(
        logprobs, prox, behav, torch.ones(2), torch.ones(2), behav_imp_weight_cap=5.0
    )
    # only token 0 counts: u = 1, w = 1, A = 1  ->  loss = -1
    assert loss.item() == pytest.approx(-1.0)
    assert stats["loss/behav_weight_mean"] == pytest.approx(1.0)


# ---------------------------------------------------------------- normaliser and gradient


def test_n_valid_tokens_overrides_the_denominator() -> None:
    loss, stats = loss_of([1.1, 0.9], [2.0, -1.0], n_valid_tokens=10)
    # -(2.2 - 0.9) / 10 = -0.13
    assert loss.item() == pytest.approx(-0.13, abs=1e-9)
    # statistics stay per-token means of this micro-batch
    assert stats["loss/n_valid_tokens"] == 2


def test_gradient_is_hand_derived_on_unclipped_and_zero_on_clipped_tokens() -> None:
    inputs = make_inputs(
        u=[1.1, 1.5, 1.5, 0.5, 1.0],
        adv=[1.5, 2.0, -1.0, -1.0, 4.0],
        w=[2.0, 1.0, 1.0, 1.0, 1.0],
        mask=[1, 1, 1, 1, 0],
    )
    loss, _ = decoupled_ppo_loss(*inputs)
    loss.backward()
    # d loss / d logprob = -(w * u * A) / n on unclipped tokens, n = 4 valid tokens
    # token 0: -(2 * 1.1 * 1.5) / 4 = -0.825   (inside the trust region)
    # token 1: clipped above with A > 0 -> 0
    # token 2: u = 1.5 > 1.2 but A < 0, unclipped: -(1 * 1.5 * -1) / 4 = 0.375
    # token 3: clipped below with A < 0 -> 0
    # token 4: masked -> 0
    expected = [-0.825, 0.0, 0.375, 0.0, 0.0]
    assert inputs[0].grad.tolist() == pytest.approx(expected, abs=1e-12)


def test_gradient_scales_with_n_valid_tokens() -> None:
    inputs = make_inputs(u=[1.1, 1.5], adv=[1.5, -1.0], w=[2.0, 1.0])
    loss, _ = decoupled_ppo_loss(*inputs, n_valid_tokens=6)
    loss.backward()
    # -(2 * 1.1 * 1.5) / 6 = -0.55; -(1 * 1.5 * -1) / 6 = 0.25
    assert inputs[0].grad.tolist() == pytest.approx([-0.55, 0.25], abs=1e-12)


def test_no_gradient_flows_into_proximal_or_behaviour_logprobs() -> None:
    logprobs, prox, behav, adv, mask = make_inputs([1.1, 0.9], [1.0, -1.0], w=[2.0, 0.5])
    prox.requires_grad_(True)
    behav.requires_grad_(True)
    loss, _ = decoupled_ppo_loss(logprobs, prox, behav, adv, mask)
    loss.backward()
    assert prox.grad is None and behav.grad is None
    assert logprobs.grad is not None


# ---------------------------------------------------------------- statistics


def test_statistics_on_a_small_example() -> None:
    loss, stats = loss_of(
        u=[1.5, 0.5, 1.1, 0.9, 1.0],
        adv=[2.0, -1.0, 1.0, -1.0, 1.0],
        w=[1.0, 1.0, 2.0, 0.5, 8.0],
        mask=[1, 1, 1, 1, 0],
    )
    # objectives: 2.4, -0.8, 2 * 1.1 = 2.2, 0.5 * -0.9 = -0.45; sum 3.35  ->  loss = -3.35/4
    assert loss.item() == pytest.approx(-0.8375, abs=1e-9)
    # tokens 0 and 1 clipped: 2/4
    assert stats["loss/clipfrac"] == pytest.approx(0.5)
    # k3 = (u - 1) - ln u: 0.0945349 + 0.1931472 + 0.0046898 + 0.0053605 = 0.2977324; / 4
    assert stats["loss/approx_kl"] == pytest.approx(0.0744331, abs=1e-6)
    # (1 + 1 + 2 + 0.5) / 4 = 1.125; the masked weight 8 counts in neither mean nor max
    assert stats["loss/behav_weight_mean"] == pytest.approx(1.125)
    assert stats["loss/behav_weight_max"] == pytest.approx(2.0)
    assert stats["loss/n_valid_tokens"] == 4
    assert stats["loss/n_capped_tokens"] == 0


def test_approx_kl_is_zero_at_the_proximal_policy() -> None:
    _, stats = loss_of([1.0, 1.0, 1.0], [1.0, -2.0, 3.0], w=[0.5, 1.0, 3.0])
    assert stats["loss/approx_kl"] == pytest.approx(0.0, abs=1e-12)
    assert stats["loss/clipfrac"] == 0.0


# ---------------------------------------------------------------- advantages


def test_batch_normalised_advantages_hand_values() -> None:
    adv = compute_advantages(torch.tensor([5.0, -5.0, 5.0, 5.0]))
    # mean = 2.5; deviations 2.5, -7.5, 2.5, 2.5; var = (3 * 6.25 + 56.25) / 4 = 18.75
    # std = 4.330127; 2.5 / 4.330127 = 0.577350; -7.5 / 4.330127 = -1.732051
    assert adv.tolist() == pytest.approx([0.577350, -1.732051, 0.577350, 0.577350], abs=1e-5)
    assert adv.dtype == torch.float32
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert adv.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)


def test_all_equal_rewards_give_zero_advantages() -> None:
    for rewards in ([3.0, 3.0, 3.0], [-5.0], [0.0, 0.0]):
        adv = compute_advantages(torch.tensor(rewards))
        assert not torch.isnan(adv).any()
        assert adv.tolist() == [0.0] * len(rewards)


def test_group_normalisation_is_per_group_id() -> None:
    rewards = torch.tensor([1.0, 10.0, 3.0, 30.0, 7.0, 7.0, 0.0])
    group_ids = torch.tensor([0, 1, 0, 1, 2, 2, 3])
    adv = compute_advantages(rewards, group_ids)
    # group 0 {1, 3}: mean 2, std 1 -> -1, 1; group 1 {10, 30}: mean 20, std 10 -> -1, 1
    # group 2 {7, 7}: all equal -> 0, 0; group 3 {0}: a single sample -> 0
    assert adv.tolist() == pytest.approx([-1.0, -1.0, 1.0, 1.0, 0.0, 0.0, 0.0], abs=1e-5)
    # the batch normalisation of the same rewards is different
    assert not torch.allclose(compute_advantages(rewards), adv, atol=1e-3)
