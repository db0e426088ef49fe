"""Decoupled PPO (paper section 5.2) and the paper's advantages, readable top to bottom.

Three policies: behaviour (sampled the tokens; log-probs from the inference engine),
proximal (the trainer's weights at the start of this training step; log-probs recomputed
by a forward pass), and theta (being optimised). All tensors are shaped like the packed
token stream: [T], one entry per token, with loss_mask 1 on generated tokens.

    L = mean over valid tokens of -(pi_prox / pi_behav) * min(u * A, clip(u, 1-eps, 1+eps) * A)
    u = pi_theta / pi_prox

Naive PPO is the special case prox = behav (pass behaviour log-probs as proximal).
"""

from __future__ import annotations

import torch


def behaviour_weight_mask(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    behav_imp_weight_cap: float | None = None,
) -> torch.Tensor:
    """Tokens that count in the loss: generated, and with a behaviour weight within the cap.

    Depends only on the proximal and behaviour policies, which are fixed during a training
    step, so the trainer can count the valid tokens of a whole minibatch before the update.
    """
    valid = loss_mask.bool()
    if behav_imp_weight_cap is not None:
        weight = torch.exp(proximal_logprobs - behaviour_logprobs)
        valid = valid & (weight <= behav_imp_weight_cap)
    return valid


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    behav_imp_weight_cap: float | None = None,
    n_valid_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled PPO loss of one micro-batch and its statistics.

    n_valid_tokens is the normaliser: the valid-token count of the whole minibatch across
    all micro-batches and data-parallel ranks, so that the summed gradient does not depend
    on how the minibatch was cut. None means this micro-batch's own count (a plain mean).
    """
    valid = behaviour_weight_mask(
        proximal_logprobs, behaviour_logprobs, loss_mask, behav_imp_weight_cap
    )
    n_local = valid.sum()
    denom = n_valid_tokens if n_valid_tokens is not None else n_local.clamp(min=1)

    # Behaviour weight pi_prox / pi_behav: a constant that corrects for stale sampling.
    behav_weight = torch.exp(proximal_logprobs - behaviour_logprobs).detach()
    # u = pi_theta / pi_prox: the trust region is centred on the proximal policy.
    log_ratio = logprobs - proximal_logprobs.detach()
    ratio = torch.exp(log_ratio)
    surrogate = ratio * advantages
    surrogate_clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip) * advantages
    objective = behav_weight * torch.minimum(surrogate, surrogate_clipped)
    # Select, never multiply by the mask: an excluded token's weight may be inf (0 * inf = nan).
    zero = torch.zeros_like(objective)
    loss = -torch.where(valid, objective, zero).sum() / denom

    with torch.no_grad():
        n = n_local.clamp(min=1)
        clipped = (surrogate_clipped < surrogate) & valid
        stats = {
            "loss/clipfrac": (clipped.sum() / n).item(),
            # k3 estimator of KL(prox || theta): non-negative, low variance.
            "loss/approx_kl": torch.where(valid, (ratio - 1) - log_ratio, zero).sum().div(n).item(),
            "loss/behav_weight_mean": torch.where(valid, behav_weight, zero).sum().div(n).item(),
            "loss/behav_weight_max": behav_weight[valid].max().item() if n_local else 0.0,
            "loss/n_valid_tokens": n_local.item(),
            "loss/n_capped_tokens": (loss_mask.bool() & ~valid).sum().item(),
        }
    return loss, stats


def compute_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sequence advantages with gamma = lambda = 1 and no critic.

    Every token of a response gets its sequence's normalised final reward. By default
    (the paper) rewards are normalised over the whole global batch; with group_ids each
    reward is normalised within the samples of its own prompt (GRPO style).
    """
    rewards = rewards.to(torch.float64)
    if group_ids is None:
        return ((rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)).float()
    adv = torch.empty_like(rewards)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        r = rewards[sel]
        adv[sel] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return adv.float()
