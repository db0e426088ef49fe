"""The objective: decoupled PPO (paper section 5.2) and the knobs of the objectives people
bring, readable top to bottom. Each knob is one formula; `ppo.recipe` sets them to a
paper's values (RECIPES in areal/trainer/ppo_config.py, with the section and its checks), the
`areal` recipe is the paper's objective.

Three policies: behaviour (sampled the tokens; log-probs from the inference engine),
proximal (the trainer's weights at the start of this training step; log-probs recomputed
by a forward pass, or approximated: `prox_approx`), and theta (being optimised). Tensors
are shaped like the packed token stream, [T], one entry per token, loss_mask 1 on
generated tokens; `seq_lens` cuts the stream into its sequences.

Per valid token t of sequence i (valid: generated, and kept by the behaviour weight's mask
and the M2PO mask):

    w = pi_prox / pi_behav                  behaviour weight (a constant; 1 for naive PPO;
                                            corrected as the table below says)
    u = pi_theta / pi_prox                  importance_sampling_level=token (PPO)
    u = exp(mean_t log(pi_theta/pi_prox))   =sequence (GSPO: one ratio per sequence, and its
                                            w = exp(mean_t log w)); =sequence_token: the same
                                            value, each token with its own gradient
    ppo:   obj = w * min(u A, clip(u, 1 - eps_clip, 1 + eps_clip_higher) A)
           dual clip (c_clip): where A < 0, min(...) becomes max(min(...), c_clip A)
    cispo: obj = w * sg[clip(u, 1 - eps_clip, 1 + eps_clip_higher)] * A * log pi_theta
           cispo_mask: sg[obj] where A > 0 and u > 1 + eps_clip_higher, or A < 0 and
           u < 1 - eps_clip (MiniMax-M1's token mask M)
           cispo_ratio=behaviour: u becomes w * u = pi_theta/pi_behav (MiniMax-M1's r) and
           w becomes 1: the clip bounds the behaviour weight too
    sapo:  obj = w * 4 / tau * sigmoid(tau * (u - 1)) * A,  tau = sapo_tau_pos if A > 0
                                            else sapo_tau_neg (the gate's slope is 1 at u = 1)
    loss  = agg(-obj) + kl_coef * agg(KL(theta || ref))  [kl_in=loss]  - entropy_coef * agg(H)

The behaviour weight's correction (behav_imp_weight_*: mode, level, floor, cap). W is the
weight at the level, over the sequence's tokens in the loss (its generated tokens, for the
mask itself): token W = w_t, sequence W = prod_t w_t, geometric W = exp(mean_t log w_t).

| mode     | outside [floor, cap]                         | presets (recipes)                  |
|----------|----------------------------------------------|------------------------------------|
| mask     | the token (token) or its whole sequence      | areal: cap (null: off; AReaL's 5); |
|          | leaves the loss; kept tokens keep their w    | icepop [0.5, 5] token; mis: cap 2, |
|          |                                              | sequence; seq_mask_tis [0.5, 5],   |
|          |                                              | geometric                          |
| truncate | every token's weight becomes clamp(W, floor, | tis: cap 2, token (TIS's C)        |
|          | cap) (in place of the ratio level's w)       |                                    |

On tokens sampled by the trainer's own current weights, w is the engine-vs-trainer ratio
pi_trainer / pi_engine, so the same block corrects that mismatch (TIS's and IcePop's case).

| loss_agg                 | agg(x)                                                    |
|--------------------------|-----------------------------------------------------------|
| token_mean (the paper)   | sum of x over valid tokens / valid tokens                 |
| seq_mean_token_mean      | mean over sequences of (sum_t x / valid tokens of the seq)|
| seq_mean_token_sum       | mean over sequences of sum_t x                            |
| seq_mean_token_sum_norm  | mean over sequences of sum_t x / loss_agg_norm_len        |

"Sequences" are those with at least one valid token. The denominators are the whole
minibatch's (`n_norm`, summed over micro-batches and data-parallel ranks by the trainer),
so the summed gradient does not depend on how the minibatch was cut.

KL estimators of log r = log pi_theta/pi_ref: k1 = log r, k2 = (log r)^2 / 2,
k3 = 1/r - 1 + log r (Schulman's). Advantages are per sequence (gamma = lambda = 1, no
critic), from rewards shaped first (`shape_rewards`): see `compute_advantages`; REINFORCE++'s
are per token (`token_advantages`), and so are PPO's with a critic (`gae_advantages`: GAE
with the critic's values; the critic's own loss is `value_loss`).

These take packed streams; trainer/ppo_batch.py applies them to a training step's batch
(its per-token tensors, what spans its data-parallel ranks, the loss of each micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from areal.trainer.ppo_config import GROUP_ESTIMATORS, TOKEN_ESTIMATORS, PPOConfig

ADV_EPS = 1e-6
"""Added to a standard deviation before dividing by it."""


def _ppo(cfg: Any) -> PPOConfig:
    """The PPO section of an ExperimentConfig, or a PPOConfig itself."""
    return cfg.ppo if hasattr(cfg, "ppo") else cfg


def _max_new_tokens(cfg: Any, max_new_tokens: int | None) -> int | None:
    if max_new_tokens is not None:
        return max_new_tokens
    return cfg.rollout.max_new_tokens if hasattr(cfg, "rollout") else None


# ---------------------------------------------------------------- rewards and advantages


def shape_rewards(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    cfg: Any,
    *,
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """Per-sequence rewards after shaping (float64): (reward + reward_bias) * reward_scale,
    then DAPO's soft overlong punishment on answers of `lengths` generated tokens:

        - overlong_penalty * clamp((length - (max_new_tokens - buffer)) / buffer, 0, 1)

    (buffer = overlong_buffer, null: a fifth of max_new_tokens).

    cfg: an ExperimentConfig, or a PPOConfig with `max_new_tokens` given. `truncated` (cut
    at max_new_tokens, no EOS) is taken by compute_advantages (mask_truncated); it is here
    so that every per-sample fact the shaping may use arrives in one call.
    """
    ppo = _ppo(cfg)
    assert len(rewards) == len(lengths) == len(truncated)
    r = (torch.as_tensor(rewards, dtype=torch.float64) + ppo.reward_bias) * ppo.reward_scale
    if ppo.overlong_penalty:
        max_len = _max_new_tokens(cfg, max_new_tokens)
        if max_len is None:
            raise ValueError("the overlong penalty needs max_new_tokens (rollout.max_new_tokens)")
        buffer = ppo.with_lengths(max_len).overlong_buffer
        excess = torch.as_tensor(lengths, dtype=torch.float64) - (max_len - buffer)
        r = r - ppo.overlong_penalty * (excess / buffer).clamp(0.0, 1.0)
    return r


def _group_mean(x: torch.Tensor, group_ids: torch.Tensor, leave_one_out: bool = False):
    """Each entry's group mean (of the group's others with leave_one_out)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=x.dtype).index_add(0, inverse, x)
    n = counts.to(x.dtype)[inverse]
    if leave_one_out:
        return (sums[inverse] - x) / (n - 1).clamp(min=1)
    return sums[inverse] / n


def _group_std(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Each entry's group standard deviation (population: divided by n)."""
    mean = _group_mean(x, group_ids)
    return _group_mean((x - mean) ** 2, group_ids).sqrt()


def _normalise(
    x: torch.Tensor, group_ids: torch.Tensor | None, over: str, divide: bool
) -> torch.Tensor:
    """x - mean, then / (std + ADV_EPS) if `divide`, over each sample's set: the batch, its
    group, or none (x as it is)."""
    if over == "none":
        return x
    if over == "batch":
        mean, std = x.mean(), x.std(unbiased=False)
    else:
        mean, std = _group_mean(x, group_ids), _group_std(x, group_ids)
    return (x - mean) / (std + ADV_EPS) if divide else x - mean


_ESTIMATORS = {
    "grpo": (("group", True),),
    "dr_grpo": (("group", False),),
    "reinforce_pp_seq": (("batch", True),),
    "reinforce_pp_baseline": (("group", False), ("batch", True)),
}
"""adv_estimator -> its normalisation steps (over which set, divide by the std), in order."""


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    cfg: Any = None,
    *,
    truncated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence advantages (float32) from shaped rewards r; every token of a response
    gets its sequence's. Standard deviations are the population's (divided by n), plus
    ADV_EPS; "group" is the samples of one prompt (group_ids).

    | adv_estimator          | A                                                        |
    |------------------------|----------------------------------------------------------|
    | norm (the paper)       | (r - mean_S) / std_S over S = adv_norm's set (batch,     |
    |                        | group; none: A = r); no division with adv_std_norm=false |
    | grpo                   | (r - mean_group) / std_group                             |
    | dr_grpo                | r - mean_group                                           |
    | rloo                   | r - mean of the group's other samples                    |
    | reinforce_pp_seq       | (r - mean_batch) / std_batch                             |
    | reinforce_pp_baseline  | x = r - mean_group, then (x - mean_batch x) / std_batch x|

    reinforce_pp (the paper's, per token) is token_advantages'. With mask_truncated, samples
    whose `truncated` is true get A = 0 after the above (their rewards still count in the
    means). cfg: a PPOConfig or an ExperimentConfig; None = the
    paper's (batch normalisation, or group with group_ids given).
    """
    if cfg is None:
        cfg = PPOConfig(adv_norm="batch" if group_ids is None else "group")
    ppo = _ppo(cfg)
    r = torch.as_tensor(rewards, dtype=torch.float64)
    group_ids = None if group_ids is None else torch.as_tensor(group_ids)
    est = ppo.adv_estimator
    assert est not in TOKEN_ESTIMATORS, f"adv_estimator={est} is per token: token_advantages"
    level = ppo.adv_norm if est == "norm" else None
    if (est in GROUP_ESTIMATORS or level == "group") and group_ids is None:
        raise ValueError(f"adv_estimator={est} (adv_norm={level}) needs the samples' group_ids")
    if est == "rloo":
        adv = r - _group_mean(r, group_ids, leave_one_out=True)
    else:
        steps = _ESTIMATORS.get(est) or ((level, ppo.adv_std_norm),)  # norm: adv_norm's
        adv = r
        for over, divide in steps:
            adv = _normalise(adv, group_ids, over, divide)
    if ppo.mask_truncated and truncated is not None:
        adv = torch.where(torch.as_tensor(truncated).bool(), 0.0, adv)
    return adv.float()


def kl_to_go(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """At each token t of one sequence, the sum of kl over its `mask` tokens s >= t."""
    kl = torch.where(mask.bool(), kl.to(torch.float64), 0.0)
    return torch.flip(torch.cumsum(torch.flip(kl, [0]), 0), [0])


def token_advantages(
    rewards: torch.Tensor,
    masks: Sequence[torch.Tensor],
    cfg: Any,
    *,
    kls: Sequence[torch.Tensor] | None = None,
    truncated: torch.Tensor | None = None,
    sum_over_ranks: Callable[[list[float]], list[float]] | None = None,
) -> list[torch.Tensor]:
    """REINFORCE++ (Hu 2025; adv_estimator=reinforce_pp): per-token advantages (float32) of
    these sequences, from their shaped rewards r, generated-token masks and, with kl_in=reward,
    per-token KL to the reference (under the behaviour policy). At token t of sequence i:

        G_t = r_i - kl_coef * sum_{s >= t} KL_s      (the KL's return-to-go; G_t = r_i else)
        A_t = (G_t - mean G) / (std G + ADV_EPS)     mean, population std over every
                                                     generated token of the batch

    so a sequence counts once per generated token. sum_over_ranks sums a list of floats over
    the data-parallel ranks (each holds its own sequences); None = these are the batch. With
    mask_truncated, truncated samples get 0 after the above (their tokens still count).
    """
    ppo = _ppo(cfg)
    total = sum_over_ranks or (lambda xs: xs)
    kl_on = ppo.kl_coef > 0 and ppo.kl_in == "reward"
    returns = []
    for i, mask in enumerate(masks):
        g = torch.full(mask.shape, float(rewards[i]), dtype=torch.float64)
        if kl_on:
            assert kls is not None, "kl_in=reward needs the per-token KL"
            g = g - ppo.kl_coef * kl_to_go(kls[i], mask)
        returns.append(g)
    return _whiten_tokens(returns, masks, True, True, ppo, truncated, total)


def _whiten_tokens(
    xs: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    centre: bool,
    divide: bool,
    ppo: PPOConfig,
    truncated: torch.Tensor | None,
    total: Callable[[list[float]], list[float]],
) -> list[torch.Tensor]:
    """Per-token values whitened over the generated tokens of every sequence (of all ranks:
    `total` sums over them), float32 and 0 off them: x - mean if `centre`, then / (std +
    ADV_EPS) if `divide`; truncated samples get 0 with mask_truncated."""
    on = [m.bool() for m in masks]
    kept = [x[m] for x, m in zip(xs, on, strict=True)]  # the generated tokens' x
    mean, std = 0.0, 1.0 - ADV_EPS
    if centre:
        s, n = total([sum(float(x.sum()) for x in kept), float(sum(len(x) for x in kept))])
        mean = s / max(n, 1.0)
        (sq,) = total([sum(float(((x - mean) ** 2).sum()) for x in kept)])
        std = (sq / max(n, 1.0)) ** 0.5 if divide else std
    out = []
    for i, x in enumerate(xs):
        adv = (x - mean) / (std + ADV_EPS)
        if ppo.mask_truncated and truncated is not None and bool(truncated[i]):
            adv = torch.zeros_like(adv)
        out.append(torch.where(on[i], adv, 0.0).float())
    return out


def token_rewards(
    rewards: torch.Tensor,
    masks: Sequence[torch.Tensor],
    cfg: Any,
    kls: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """GAE's per-token rewards (float64) of each sequence: its shaped reward r_i at its last
    generated token, less kl_coef * KL_t at every generated token t with kl_in=reward."""
    ppo = _ppo(cfg)
    out = []
    for i, mask in enumerate(masks):
        on = mask.bool()
        r = torch.zeros(mask.shape, dtype=torch.float64)
        if on.any():
            r[int(on.nonzero()[-1, 0])] = float(rewards[i])
        if ppo.kl_coef > 0 and ppo.kl_in == "reward":
            assert kls is not None, "kl_in=reward needs the per-token KL"
            r = r - ppo.kl_coef * torch.where(on, kls[i].to(torch.float64), 0.0)
        out.append(r)
    return out


def gae(
    rewards: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    gamma: float,
    lam: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalized advantage estimation (Schulman et al. 2016) over each sequence's generated
    tokens (`masks`; other tokens, e.g. a tool's output, are the environment's and skipped:
    the generated tokens are the consecutive steps). With t' the next generated token:

        delta_t = r_t + gamma V_t' - V_t      (V after the last token = 0: the answer ends)
        A_t     = delta_t + gamma lam A_t'    returns R_t = A_t + V_t

    Returns (A, R) per sequence, float64, 0 off the generated tokens. The sequences run
    side by side as rows of a [N, longest] matrix, one column per step back in time."""
    on = [m.bool() for m in masks]
    n_gen = [int(m.sum()) for m in on]
    width = max(n_gen, default=0)
    r = torch.zeros(len(on), width, dtype=torch.float64)
    v = torch.zeros(len(on), width, dtype=torch.float64)
    for i, m in enumerate(on):  # left-aligned: the padding comes after each sequence's end
        r[i, : n_gen[i]] = rewards[i].to(torch.float64)[m]
        v[i, : n_gen[i]] = values[i].to(torch.float64)[m]
    live = torch.arange(width)[None, :] < torch.tensor(n_gen)[:, None]  # [N, width]
    adv = torch.zeros_like(r)
    next_v = torch.zeros(len(on), dtype=torch.float64)
    next_a = torch.zeros(len(on), dtype=torch.float64)
    for t in range(width - 1, -1, -1):
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        adv[:, t] = torch.where(live[:, t], a, 0.0)
        next_a = adv[:, t]
        next_v = torch.where(live[:, t], v[:, t], 0.0)
    advs, rets = [], []
    for i, m in enumerate(on):
        a = torch.zeros(m.shape, dtype=torch.float64)
        a[m] = adv[i, : n_gen[i]]
        advs.append(a)
        rets.append(torch.where(m, a + values[i].to(torch.float64), 0.0))
    return advs, rets


def gae_advantages(
    rewards: torch.Tensor,
    masks: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    cfg: Any,
    *,
    kls: Sequence[torch.Tensor] | None = None,
    truncated: torch.Tensor | None = None,
    sum_over_ranks: Callable[[list[float]], list[float]] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO with a critic (adv_estimator=gae): per-token advantages (float32) and returns
    (float64) of these sequences from their shaped rewards r, generated-token masks, the
    critic's values (old: before this step's updates) and, with kl_in=reward, per-token KL
    to the reference: token_rewards -> gae(gamma, lam) -> the advantages whitened over every
    generated token of the batch as adv_norm and adv_std_norm say (batch: mean and
    population std over all ranks' tokens, as token_advantages'; none: as they are). With
    mask_truncated, truncated samples get A = 0 (their returns still train the critic)."""
    ppo = _ppo(cfg)
    total = sum_over_ranks or (lambda xs: xs)
    per_token = token_rewards(rewards, masks, ppo, kls)
    advs, returns = gae(per_token, values, masks, ppo.gamma, ppo.lam)
    centre = ppo.adv_norm == "batch"
    advs = _whiten_tokens(advs, masks, centre, centre and ppo.adv_std_norm, ppo, truncated, total)
    return advs, returns


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None,
    n_norm: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss of one packed stream (as OpenRLHF's and verl's), token mean
    over the generated tokens (`mask`) of the whole minibatch (n_norm of them; None = this
    stream's):

        0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2),  eps = value_clip

    (value_clip None: 0.5 (V - R)^2). The clip keeps the critic near the values that made
    the advantages, as the policy's clip keeps the policy near the proximal one."""
    on = mask.bool()
    zero = torch.zeros_like(values)
    v = torch.where(on, values, zero)
    old = torch.where(on, old_values.to(values.dtype), zero)
    ret = torch.where(on, returns.to(values.dtype), zero)
    per_token = (v - ret) ** 2
    clipped = torch.zeros_like(on)
    if value_clip is not None:
        v_clipped = old + torch.clamp(v - old, -value_clip, value_clip)
        per_token_clipped = (v_clipped - ret) ** 2
        clipped = on & (per_token_clipped > per_token)
        per_token = torch.maximum(per_token, per_token_clipped)
    n = max(float(int(on.sum()) if n_norm is None else n_norm), 1.0)
    loss = 0.5 * torch.where(on, per_token, zero).sum() / n
    n_local = max(int(on.sum()), 1)
    stats = {
        "critic/clipfrac": float(clipped.sum()) / n_local,
        "critic/n_tokens": float(on.sum()),
    }
    return loss, stats


# ---------------------------------------------------------------- which tokens count


def level_log_weight(
    log_w: torch.Tensor,
    on: torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor | None,
    level: str,
) -> torch.Tensor:
    """Each token's log of its behaviour weight at `level` (behav_imp_weight_level): token:
    log w_t itself; sequence: the sum of log w over its sequence's `on` tokens (the log of
    their product); geometric: their mean. log_w must be 0 off `on`."""
    if level == "token":
        return log_w
    assert seq_lens is not None, f"behav_imp_weight_level={level} needs seq_lens"
    seq_id = _segments(seq_lens, len(log_w), log_w.device)
    per_seq = _per_seq(log_w, seq_id, len(seq_lens))
    if level == "geometric":
        per_seq = per_seq / _per_seq(on.to(log_w.dtype), seq_id, len(seq_lens)).clamp(min=1)
    return per_seq[seq_id]


def behaviour_weight_mask(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    behav_imp_weight_cap: float | None = None,
    *,
    floor: float | None = None,
    level: str = "token",
    seq_lens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Tokens that count in the loss: generated, and with a behaviour weight (at `level`,
    over each sequence's generated tokens) within [floor, cap]; with a sequence level a
    sequence goes whole.

    Depends only on the proximal and behaviour policies, which are fixed during a training
    step, so the trainer can count the valid tokens of a whole minibatch before the update.
    """
    valid = loss_mask.bool()
    if behav_imp_weight_cap is None and floor is None:
        return valid
    log_w = torch.where(valid, proximal_logprobs - behaviour_logprobs, 0.0)
    weight = torch.exp(level_log_weight(log_w, valid, seq_lens, level))
    if behav_imp_weight_cap is not None:
        valid = valid & (weight <= behav_imp_weight_cap)
    if floor is not None:
        valid = valid & (weight >= floor)
    return valid


def correction_mask(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    cfg: Any,
) -> torch.Tensor:
    """behaviour_weight_mask with the config's bounds (none with mode=truncate)."""
    ppo = _ppo(cfg)
    floor, cap = ppo.behav_mask_bounds()
    return behaviour_weight_mask(
        proximal_logprobs, behaviour_logprobs, loss_mask, cap,
        floor=floor, level=ppo.behav_imp_weight_level, seq_lens=seq_lens,
    )  # fmt: skip


def m2po_threshold(second_moments: torch.Tensor, tau: float) -> float:
    """M2PO's cut (Zheng et al. 2025): tokens with m = (log pi_prox/pi_behav)^2 >= the
    returned value are masked. The largest values are removed, equal values together, until
    the mean of the rest is <= tau; inf when nothing needs removing.

    `second_moments` holds m of every valid token of the batch (all ranks' together).
    """
    m = torch.sort(second_moments.to(torch.float64).flatten(), descending=True).values
    n = len(m)
    if n == 0 or m.mean() <= tau:
        return float("inf")
    # rest_mean[k]: the mean after removing the k largest (k = 0 .. n-1).
    suffix = torch.flip(torch.cumsum(torch.flip(m, [0]), 0), [0])  # suffix[k] = sum of m[k:]
    rest_mean = suffix / torch.arange(n, 0, -1, dtype=torch.float64)
    # Only between two different values can the cut fall (k >= 1: m[k-1] > m[k]).
    boundary = torch.zeros(n, dtype=torch.bool)
    boundary[1:] = m[:-1] > m[1:]
    ok = (boundary & (rest_mean <= tau)).nonzero()
    return float(m[ok[0, 0] - 1]) if len(ok) else float(m[-1])  # none: everything goes


def m2po_cap(second_moments: torch.Tensor, tau: float) -> float:
    """M2PO's cut as its authors' code makes it (Infini-AI-Lab/M2PO, kpo_clip_harmful_tokens):
    the smallest value c of the m given at which capping every m at c brings their mean to
    tau: mean(min(m, c)) >= tau. Tokens with m >= c are masked (their code's clip at
    |log r| < sqrt(c), which drops these tokens' gradient); inf when mean(m) <= tau. Capped,
    not removed, the largest values still count in the mean, so over the same m it masks at
    least what m2po_threshold's removal does."""
    m = torch.sort(second_moments.to(torch.float64).flatten()).values
    n = len(m)
    if n == 0 or m.mean() <= tau:
        return float("inf")
    # capped[k]: sum of min(m_i, m[k]) = the k + 1 smallest, then m[k] for each of the rest.
    capped = torch.cumsum(m, 0) + m * torch.arange(n - 1, -1, -1, dtype=torch.float64)
    return float(m[(capped >= tau * n).nonzero()[0, 0]])


def m2po_candidates(
    log_w: torch.Tensor, advantages: torch.Tensor | None, valid: torch.Tensor, ppo: PPOConfig
) -> torch.Tensor:
    """The tokens M2PO's cut weighs and may mask (log_w = log pi_prox/pi_behav): every valid
    one (m2po_tokens=all), or those whose weight has moved in their advantage's direction
    (trust_region: A > 0 with w > 1, A < 0 with w < 1), the ones a trust region bounds; a
    token whose probability moved against its advantage keeps its gradient, which corrects
    that move."""
    if ppo.m2po_tokens == "all":
        return valid
    assert advantages is not None, "m2po_tokens=trust_region needs the advantages"
    return valid & (((advantages > 0) & (log_w > 0)) | ((advantages < 0) & (log_w < 0)))


def m2po_cut(second_moments: torch.Tensor, ppo: PPOConfig) -> float:
    """M2PO's cut over the candidates' m (every rank's): tokens with m >= it are masked."""
    if ppo.m2po_tokens == "all":
        return m2po_threshold(second_moments, ppo.m2po_tau)
    return m2po_cap(second_moments, ppo.m2po_tau)


def token_mask(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: Any,
    seq_lens: Sequence[int] | torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """The valid tokens of one batch: generated, kept by the behaviour weight's mask, and not
    cut by the M2PO mask (over these tokens; the trainer applies it over the whole batch).
    seq_lens: needed with a sequence-level mask; None = one sequence. advantages: needed
    with m2po_tokens=trust_region."""
    ppo = _ppo(cfg)
    lens = [len(loss_mask)] if seq_lens is None else seq_lens
    valid = correction_mask(proximal_logprobs, behaviour_logprobs, loss_mask, lens, ppo)
    if ppo.m2po_tau is not None:
        log_w = (proximal_logprobs - behaviour_logprobs).double()
        weighed = m2po_candidates(log_w, advantages, valid, ppo)
        valid = valid & ~(weighed & (log_w**2 >= m2po_cut(log_w[weighed] ** 2, ppo)))
    return valid


def approx_proximal_logprobs(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, versions: torch.Tensor, version: int
) -> torch.Tensor:
    """prox_approx=loglinear (upstream AReaL): the proximal log-prob interpolated between the
    behaviour's and theta's by policy version, without a proximal forward pass:

        log pi_prox ~ log pi_behav + alpha (log pi_theta - log pi_behav)
        alpha = (v_prox - v_behav) / (v_theta - v_behav),  v_prox = version, v_theta = version + 1

    A token of the current version (alpha = 0) keeps its behaviour log-prob, exact for
    tokens generated by the weights the trainer holds. Detached: a constant of the loss.
    """
    v_behav = versions.to(torch.float64)
    alpha = ((version - v_behav) / (version + 1 - v_behav)).clamp(0.0, 1.0)
    behav = behaviour_logprobs.to(torch.float64)
    prox = behav + alpha * (logprobs.detach().to(torch.float64) - behav)
    return prox.to(logprobs.dtype)


# ---------------------------------------------------------------- the loss


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(theta || ref) from samples of theta (log r = logprobs - ref)."""
    log_r = logprobs - ref_logprobs
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    assert estimator == "k3", estimator
    return torch.exp(-log_r) - 1 + log_r


def _segments(
    seq_lens: Sequence[int] | torch.Tensor, n_tokens: int, device: torch.device
) -> torch.Tensor:
    """The sequence index of each token of the packed stream."""
    lens = torch.as_tensor(seq_lens, dtype=torch.long, device=device)
    assert int(lens.sum()) == n_tokens, f"seq_lens sum to {int(lens.sum())}, not {n_tokens}"
    return torch.repeat_interleave(torch.arange(len(lens), device=device), lens)


def _per_seq(x: torch.Tensor, seq_id: torch.Tensor, n_seqs: int) -> torch.Tensor:
    return torch.zeros(n_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_id, x)


def norm_count(valid: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor, cfg: Any) -> int:
    """What loss_agg divides by, counted on these tokens: valid tokens (token_mean) or
    sequences with a valid token. The trainer sums it over a minibatch into n_norm."""
    if _ppo(cfg).loss_agg == "token_mean":
        return int(valid.sum())
    seq_id = _segments(seq_lens, len(valid), valid.device)
    return int((_per_seq(valid.long(), seq_id, len(seq_lens)) > 0).sum())


def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    cfg: PPOConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    n_norm: float | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective of one packed stream (module docstring) and its statistics.

    n_norm is loss_agg's denominator for the whole minibatch (norm_count summed over its
    parts), None = this stream's own. ref_logprobs: needed when kl_coef > 0 and kl_in=loss;
    entropy (per token): needed when entropy_coef > 0. valid: the tokens that count, None =
    token_mask over this stream (the trainer passes the mask it made over the whole batch).
    """
    if valid is None:
        valid = token_mask(
            proximal_logprobs, behaviour_logprobs, loss_mask, cfg, seq_lens, advantages
        )
    valid = valid.bool()
    seq_id = _segments(seq_lens, len(logprobs), logprobs.device)
    n_tok_seq = _per_seq(valid.to(logprobs.dtype), seq_id, len(seq_lens))  # valid per sequence
    if n_norm is None:
        n_norm = norm_count(valid, seq_lens, cfg)
    n_norm = max(float(n_norm), 1.0)
    zero = torch.zeros_like(logprobs)

    # Select inputs, not outputs: an excluded token's log-probs may be anything (a weight
    # of inf), and inf * 0 in the backward of a selected output is nan.
    log_w = torch.where(valid, proximal_logprobs - behaviour_logprobs, zero).detach()
    log_u = torch.where(valid, logprobs - proximal_logprobs.detach(), zero)
    ratio, behav_weight = _ratios(logprobs, log_u, log_w, valid, seq_id, n_tok_seq, cfg)
    truncated = None
    if cfg.behav_imp_weight_mode == "truncate":  # TIS: the level's weight, clamped
        behav_weight, truncated = _truncated_weight(log_w, valid, seq_lens, cfg)
    weight = behav_weight
    if cfg.loss == "cispo" and cfg.cispo_ratio == "behaviour":  # MiniMax-M1's r, w inside
        ratio, weight = ratio * behav_weight, torch.ones_like(behav_weight)
    objective, clipped = _surrogate(ratio, advantages.to(logprobs.dtype), logprobs, valid, cfg)
    per_token = -weight * objective
    per_token, kl = _regularised(per_token, logprobs, valid, cfg, ref_logprobs, entropy)
    loss = _aggregate(torch.where(valid, per_token, zero), seq_id, n_tok_seq, cfg, n_norm)

    m2 = (proximal_logprobs - behaviour_logprobs).detach() ** 2  # M2PO's, on every token
    stats = _loss_stats(valid, loss_mask, m2, clipped, log_u, behav_weight, zero)
    if truncated is not None:
        stats["loss/behav_truncated_tokens"] = truncated.sum().item()
        seq_truncated = _per_seq(truncated.long(), seq_id, len(seq_lens)) > 0
        stats["loss/behav_truncated_seqs"] = seq_truncated.sum().item()
    if kl is not None:
        stats["loss/kl_ref"] = _token_mean(kl, valid, zero)
    if entropy is not None:
        stats["loss/entropy"] = _token_mean(entropy.detach(), valid, zero)
    return loss, stats


def _ratios(
    logprobs: torch.Tensor,
    log_u: torch.Tensor,
    log_w: torch.Tensor,
    valid: torch.Tensor,
    seq_id: torch.Tensor,
    n_tok_seq: torch.Tensor,
    ppo: PPOConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, w) at importance_sampling_level from their per-token logs (0 off the valid
    tokens): token: as they are; sequence (GSPO): exp of their mean over the sequence's
    valid tokens; sequence_token: that u's value, each token with its own gradient."""
    if ppo.importance_sampling_level == "token":
        return torch.exp(log_u), torch.exp(log_w)
    n_seqs = len(n_tok_seq)
    seq_log_u = (_per_seq(log_u, seq_id, n_seqs) / n_tok_seq.clamp(min=1))[seq_id]
    if ppo.importance_sampling_level == "sequence_token":
        lp = torch.where(valid, logprobs, torch.zeros_like(logprobs))
        seq_log_u = seq_log_u.detach() + lp - lp.detach()
    seq_log_w = (_per_seq(log_w, seq_id, n_seqs) / n_tok_seq.clamp(min=1))[seq_id]
    return torch.exp(seq_log_u), torch.exp(seq_log_w)


def _truncated_weight(
    log_w: torch.Tensor,
    valid: torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    ppo: PPOConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TIS: every token's behaviour weight the weight at behav_imp_weight_level (from the
    per-token log w, 0 off the valid tokens) clamped to [floor, cap]; and the tokens whose
    weight the clamp changed."""
    level_w = torch.exp(level_log_weight(log_w, valid, seq_lens, ppo.behav_imp_weight_level))
    weight = torch.clamp(level_w, ppo.behav_imp_weight_floor, ppo.behav_imp_weight_cap)
    return weight, valid & (weight != level_w)


def _surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    logprobs: torch.Tensor,
    valid: torch.Tensor,
    ppo: PPOConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """obj of ppo.loss per token (module docstring), before the behaviour weight; and the
    tokens whose ratio the clip reached."""
    lo, hi = 1.0 - ppo.eps_clip, 1.0 + ppo.eps_clip_higher
    clipped_ratio = torch.clamp(ratio, lo, hi)
    if ppo.loss == "ppo":
        surrogate = ratio * adv
        surrogate_clipped = clipped_ratio * adv
        objective = torch.minimum(surrogate, surrogate_clipped)
        clipped = surrogate_clipped < surrogate
        if ppo.c_clip is not None:
            dual = torch.maximum(objective, ppo.c_clip * adv)
            clipped = clipped | ((adv < 0) & (dual > objective))
            objective = torch.where(adv < 0, dual, objective)
    elif ppo.loss == "cispo":
        lp = torch.where(valid, logprobs, torch.zeros_like(logprobs))
        objective = clipped_ratio.detach() * adv * lp
        clipped = (ratio < lo) | (ratio > hi)
        if ppo.cispo_mask:  # MiniMax-M1's M: past the clip in A's direction, no gradient
            past = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
            objective = torch.where(past, objective.detach(), objective)
    else:  # sapo: a sigmoid gate of the ratio, its slope 1 at u = 1 for every temperature
        tau = torch.where(adv > 0, ppo.sapo_tau_pos, ppo.sapo_tau_neg).to(logprobs.dtype)
        objective = 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0)) * adv
        clipped = (ratio < lo) | (ratio > hi)  # reported as PPO's would be, for comparison
    return objective, clipped


def _regularised(
    per_token: torch.Tensor,
    logprobs: torch.Tensor,
    valid: torch.Tensor,
    ppo: PPOConfig,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-token loss with kl_coef * KL(theta || ref) (kl_in=loss) added and
    entropy_coef * H taken off; and the KL per token (None without it)."""
    zero = torch.zeros_like(logprobs)
    kl = None
    if ppo.kl_coef > 0 and ppo.kl_in == "loss":
        assert ref_logprobs is not None, "kl_coef > 0 with kl_in=loss needs ref_logprobs"
        ref = torch.where(valid, ref_logprobs.to(logprobs.dtype), logprobs.detach())
        kl = torch.where(valid, kl_estimate(logprobs, ref, ppo.kl_estimator), zero)
        per_token = per_token + ppo.kl_coef * kl
    if ppo.entropy_coef > 0:
        assert entropy is not None, "entropy_coef > 0 needs the per-token entropy"
        per_token = per_token - ppo.entropy_coef * torch.where(valid, entropy, zero)
    return per_token, kl


@torch.no_grad()
def _token_mean(x: torch.Tensor, valid: torch.Tensor, zero: torch.Tensor) -> float:
    """The mean of x over the valid tokens (0 without any; zero: the loss's zeros)."""
    return (torch.where(valid, x, zero).sum() / valid.sum().clamp(min=1)).item()


@torch.no_grad()
def _loss_stats(
    valid: torch.Tensor,
    loss_mask: torch.Tensor,
    m2: torch.Tensor,
    clipped: torch.Tensor,
    log_u: torch.Tensor,
    behav_weight: torch.Tensor,
    zero: torch.Tensor,
) -> dict[str, float]:
    """The statistics every loss reports: token means over the valid tokens and counts; and
    M2PO's M2 before any mask (m2: (log pi_prox/pi_behav)^2 per token) as a sum over the
    generated tokens, with their count."""
    n_local = valid.sum()
    generated = loss_mask.bool()
    return {
        "loss/clipfrac": ((clipped & valid).sum() / n_local.clamp(min=1)).item(),
        # k3 estimator of KL(prox || theta) per token: non-negative, low variance.
        "loss/approx_kl": _token_mean(torch.exp(log_u) - 1 - log_u, valid, zero),
        "loss/behav_weight_mean": _token_mean(behav_weight, valid, zero),
        "loss/behav_weight_max": behav_weight[valid].max().item() if n_local else 0.0,
        "loss/n_valid_tokens": n_local.item(),
        "loss/n_capped_tokens": (generated & ~valid).sum().item(),
        "loss/behav_log_weight_sq_sum": torch.where(generated, m2, zero).sum().item(),
        "loss/n_generated_tokens": generated.sum().item(),
    }


def _aggregate(
    per_token: torch.Tensor,
    seq_id: torch.Tensor,
    n_tok_seq: torch.Tensor,
    ppo: PPOConfig,
    n_norm: float,
) -> torch.Tensor:
    """loss_agg of a per-token loss (zero off the valid tokens) over the minibatch's n_norm."""
    if ppo.loss_agg == "token_mean":
        return per_token.sum() / n_norm
    per_seq = _per_seq(per_token, seq_id, len(n_tok_seq))
    if ppo.loss_agg == "seq_mean_token_mean":
        per_seq = per_seq / n_tok_seq.clamp(min=1)
    elif ppo.loss_agg == "seq_mean_token_sum_norm":
        if ppo.loss_agg_norm_len is None:
            raise ValueError("loss_agg=seq_mean_token_sum_norm needs ppo.loss_agg_norm_len")
        per_seq = per_seq / ppo.loss_agg_norm_len
    return per_seq.sum() / n_norm


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
    """The paper's decoupled PPO loss (the `areal` recipe) of one micro-batch:

        L = mean over valid tokens of -(pi_prox / pi_behav) * min(u A, clip(u, 1-eps, 1+eps) A)

    n_valid_tokens: the minibatch's valid tokens over all micro-batches and ranks; None =
    this micro-batch's own. Naive PPO is prox = behav (pass behaviour log-probs as proximal).
    """
    return policy_loss(
        logprobs,
        proximal_logprobs,
        behaviour_logprobs,
        advantages,
        loss_mask,
        [len(logprobs)],
        PPOConfig(eps_clip=eps_clip),
        n_norm=n_valid_tokens,
        valid=behaviour_weight_mask(
            proximal_logprobs, behaviour_logprobs, loss_mask, behav_imp_weight_cap
        ),
    )
