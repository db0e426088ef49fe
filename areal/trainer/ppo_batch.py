"""The objective (ppo.py) over one training step's batch, as trainer/step.py runs it.

ppo.py's formulas take packed streams; here they meet the trainer's batch: each rank holds
the per-token tensors of its own sequences (`TokenTensors`, keyed by the sequence's index
in the batch, in that order), and whatever spans the whole batch is summed or gathered
over the data-parallel ranks (`dp`):

| step phase      | here                                   | over the ranks               |
|-----------------|----------------------------------------|------------------------------|
| 2) advantages   | shaped_rewards: ppo.shape_rewards less | the samples' KL sums         |
|                 | the KL paid in the reward              |                              |
|                 | advantages: ppo's estimator into .adv  | token whitening (REINFORCE++,|
|                 |                                        | GAE), the critic's stats     |
| 3) masks        | valid_tokens: the behaviour weight's   | M2PO's cut (gathered)        |
|                 | mask, then M2PO's cut                  |                              |
| 4) updates      | minibatch_norm: loss_agg's count       | summed                       |
|                 | PolicyLoss: ppo.policy_loss of one     |                              |
|                 | micro-batch (the backend's loss_fn)    |                              |
|                 | ValueLoss: ppo.value_loss of one       |                              |
|                 | micro-batch (the critic's loss_fn)     |                              |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from areal.trainer import ppo as objective
from areal.trainer.parallel import DataParallel
from areal.trainer.ppo_config import TOKEN_ESTIMATORS, PPOConfig
from areal.trajectory import Trajectory, TrajectoryRef


@dataclass
class TokenTensors:
    """The per-token tensors of one sequence, aligned with the backend's log-prob stream
    (L - 1 entries: entry j is the prediction of token j + 1), or of several packed end to
    end (`cat`: one micro-batch). The rollout's three come first (`of`); step.prepare's phases
    fill in the rest, each in its turn: the passes prox, ref and old_values, the advantages
    adv and returns, the masks valid."""

    mask: torch.Tensor  # [T] float: 1 on the tokens the model generated (the loss's), else 0
    behav: torch.Tensor  # [T] behaviour log-prob per token (the engine's), 0 off `mask`
    versions: torch.Tensor  # [T] long: the policy version that generated each token, -1 off mask
    prox: torch.Tensor | None = None  # [T] proximal log-prob, 0 off `mask`
    ref: torch.Tensor | None = None  # [T] the reference's log-prob (kl_coef > 0), behav off mask
    old_values: torch.Tensor | None = None  # [T] the critic's V_old (gae), 0 off `mask`
    adv: torch.Tensor | None = None  # [T] float32 advantage per token
    returns: torch.Tensor | None = None  # [T] float32 the critic's targets R (gae)
    valid: torch.Tensor | None = None  # [T] bool: in the loss (generated, kept by the masks)

    @classmethod
    def of(cls, traj: Trajectory) -> TokenTensors:
        """The rollout's tensors of one trajectory: 0 (versions -1) on the prompt's entries."""
        n_prompt, n_out = len(traj.prompt_ids), len(traj.output_ids)
        length = n_prompt + n_out - 1
        mask = torch.zeros(length)
        mask[n_prompt - 1 :] = (
            torch.tensor(traj.loss_mask, dtype=torch.float32) if traj.loss_mask else 1.0
        )
        behav = torch.zeros(length)
        behav[n_prompt - 1 :] = torch.tensor(traj.logprobs, dtype=torch.float32)
        versions = torch.full((length,), -1, dtype=torch.long)
        versions[n_prompt - 1 :] = torch.tensor(traj.versions, dtype=torch.long)
        # Tokens the model did not generate (tool results in a concat sample) are no one's:
        # out of the loss, and out of the fresh-token check.
        versions[mask == 0] = -1
        return cls(mask=mask, behav=behav, versions=versions)

    @classmethod
    def cat(cls, parts: Sequence[TokenTensors], device: torch.device) -> TokenTensors:
        """`parts` packed end to end, on `device` (the fields they have: all have the same)."""
        return cls(
            **{
                f.name: torch.cat([getattr(p, f.name) for p in parts]).to(device)
                for f in dataclasses.fields(cls)
                if getattr(parts[0], f.name) is not None
            }
        )


# ---------------------------------------------------------------- rewards and advantages


def shaped_rewards(
    trajs: Sequence[Trajectory | TrajectoryRef],
    rewards: torch.Tensor,
    truncated: torch.Tensor,
    tokens: dict[int, TokenTensors],
    ppo: PPOConfig,
    dp: DataParallel,
    max_new_tokens: int | None,
) -> torch.Tensor:
    """objective.shape_rewards of the whole batch, less kl_coef * each sample's KL to the
    reference with kl_in=reward: under the policy that sampled it (behaviour), summed over
    its generated tokens; each rank fills in its own samples and the sum over ranks the rest."""
    shaped = objective.shape_rewards(
        rewards,
        torch.tensor([t.n_output for t in trajs]),
        truncated,
        ppo,
        max_new_tokens=max_new_tokens,
    )
    if ppo.kl_coef > 0 and ppo.kl_in == "reward":
        kl_sums = [0.0] * len(trajs)
        for i, t in tokens.items():
            kl = objective.kl_estimate(t.behav, t.ref, ppo.kl_estimator)
            kl_sums[i] = float(torch.where(t.mask.bool(), kl, 0.0).sum())
        shaped = shaped - ppo.kl_coef * torch.tensor(dp.all_reduce(kl_sums), dtype=torch.float64)
    return shaped


def advantages(
    trajs: Sequence[Trajectory | TrajectoryRef],
    tokens: dict[int, TokenTensors],
    shaped: torch.Tensor,
    truncated: torch.Tensor,
    ppo: PPOConfig,
    dp: DataParallel,
    max_new_tokens: int | None,
) -> dict[str, float]:
    """Each of this rank's sequences' advantages into its TokenTensors.adv, as
    ppo.adv_estimator says, over the whole batch: gae per token from the critic's old values
    (and the returns; gives the critic's statistics), REINFORCE++ per token, the others one
    per sequence (from `shaped`, the whole batch's), on each of its tokens."""
    if ppo.adv_estimator == "gae":
        return _gae_advantages(trajs, tokens, truncated, ppo, dp, max_new_tokens)
    if ppo.adv_estimator in TOKEN_ESTIMATORS:
        _token_advantages(trajs, tokens, truncated, ppo, dp, max_new_tokens)
        return {}
    group_ids = torch.tensor([t.group_id for t in trajs])
    adv = objective.compute_advantages(shaped, group_ids, ppo, truncated=truncated)
    for i, t in tokens.items():
        t.adv = torch.full_like(t.behav, float(adv[i]))
    return {}


def _per_token_inputs(
    trajs: Sequence[Trajectory | TrajectoryRef],
    tokens: dict[int, TokenTensors],
    truncated: torch.Tensor,
    ppo: PPOConfig,
    max_new_tokens: int | None,
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """What the per-token estimators (REINFORCE++, GAE) start from, for this rank's
    sequences: the shaped rewards, and each sequence's per-token KL when it is paid in the
    reward (kl_in=reward; else None)."""
    mine = list(tokens)
    lengths = torch.tensor([trajs[i].n_output for i in mine])
    rewards = torch.tensor([trajs[i].reward for i in mine], dtype=torch.float64)
    shaped = objective.shape_rewards(
        rewards, lengths, truncated[mine], ppo, max_new_tokens=max_new_tokens
    )
    if not (ppo.kl_coef > 0 and ppo.kl_in == "reward"):
        return shaped, None
    kls = [objective.kl_estimate(t.behav, t.ref, ppo.kl_estimator) for t in tokens.values()]
    return shaped, kls


def _token_advantages(
    trajs: Sequence[Trajectory | TrajectoryRef],
    tokens: dict[int, TokenTensors],
    truncated: torch.Tensor,
    ppo: PPOConfig,
    dp: DataParallel,
    max_new_tokens: int | None,
) -> None:
    """objective.token_advantages of this rank's sequences into .adv: the shaped reward less
    the KL's return-to-go (kl_in=reward), whitened over the generated tokens of every rank."""
    shaped, kls = _per_token_inputs(trajs, tokens, truncated, ppo, max_new_tokens)
    advs = objective.token_advantages(
        shaped, [t.mask for t in tokens.values()], ppo, kls=kls, truncated=truncated[list(tokens)],
        sum_over_ranks=lambda xs: dp.all_reduce(xs, "sum"),
    )  # fmt: skip
    for t, adv in zip(tokens.values(), advs, strict=True):
        t.adv = adv


def _gae_advantages(
    trajs: Sequence[Trajectory | TrajectoryRef],
    tokens: dict[int, TokenTensors],
    truncated: torch.Tensor,
    ppo: PPOConfig,
    dp: DataParallel,
    max_new_tokens: int | None,
) -> dict[str, float]:
    """objective.gae_advantages of this rank's sequences into .adv and .returns, from their
    .old_values; returns the critic's statistics (_value_statistics)."""
    shaped, kls = _per_token_inputs(trajs, tokens, truncated, ppo, max_new_tokens)
    masks = [t.mask for t in tokens.values()]
    values = [t.old_values for t in tokens.values()]
    advs, returns = objective.gae_advantages(
        shaped, masks, values, ppo, kls=kls, truncated=truncated[list(tokens)],
        sum_over_ranks=lambda xs: dp.all_reduce(xs, "sum"),
    )  # fmt: skip
    for t, adv, ret in zip(tokens.values(), advs, returns, strict=True):
        t.adv, t.returns = adv, ret.float()
    return _value_statistics(returns, values, masks, dp)


def _value_statistics(
    returns: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    dp: DataParallel,
) -> dict[str, float]:
    """The critic's statistics over the generated tokens of the whole batch: the old values'
    and returns' means, and the share of the returns' variance the old values explain
    (1 - Var(R - V) / Var(R); 1 is perfect, <= 0 no better than a mean)."""
    sums = [0.0] * 6  # n, sum V, sum R, sum R^2, sum (R - V), sum (R - V)^2
    for ret, mask, v in zip(returns, masks, values, strict=True):
        on = mask.bool()
        r, err = ret[on], (ret - v.double())[on]
        for k, x in enumerate((len(r), v[on].sum(), r.sum(), (r**2).sum(), err.sum())):
            sums[k] += float(x)
        sums[5] += float((err**2).sum())
    n, s_v, s_r, s_r2, s_e, s_e2 = dp.all_reduce(sums, "sum")
    n = max(n, 1.0)
    var_r = s_r2 / n - (s_r / n) ** 2
    var_e = s_e2 / n - (s_e / n) ** 2
    return {
        "critic/values_mean": s_v / n,
        "critic/returns_mean": s_r / n,
        "critic/explained_var": 1.0 - var_e / var_r if var_r > 1e-12 else 0.0,
    }


# ---------------------------------------------------------------- which tokens count


def valid_tokens(
    tokens: dict[int, TokenTensors], ppo: PPOConfig, dp: DataParallel
) -> tuple[int, int, int]:
    """Each sequence's TokenTensors.valid: generated, kept by the behaviour weight's mask
    (ppo.behav_imp_weight_*) and by M2PO's cut over the whole batch. Both depend only on the
    proximal and behaviour policies, fixed during the step, so they are made once, before
    any update. Returns the generated tokens and sequences the behaviour weight's mask took
    out, and the tokens M2PO's cut took out."""
    n_tokens = n_seqs = 0
    for t in tokens.values():
        t.valid = objective.correction_mask(t.prox, t.behav, t.mask, [len(t.mask)], ppo)
        lost = int((t.mask.bool() & ~t.valid).sum())
        n_tokens += lost
        n_seqs += lost > 0
    n_m2po = _m2po_mask(tokens, ppo, dp) if ppo.m2po_tau is not None else 0
    return n_tokens, n_seqs, n_m2po


def _m2po_mask(tokens: dict[int, TokenTensors], ppo: PPOConfig, dp: DataParallel) -> int:
    """M2PO's cut over the tokens it weighs in the whole batch (every rank's, gathered),
    applied to this rank's; returns how many of its tokens it masked."""
    log_w = [(t.prox - t.behav).double() for t in tokens.values()]
    weighed = [
        objective.m2po_candidates(lw, t.adv, t.valid, ppo)
        for t, lw in zip(tokens.values(), log_w, strict=True)
    ]
    local = [lw[w] ** 2 for lw, w in zip(log_w, weighed, strict=True)]
    cut = objective.m2po_cut(dp.all_gather(torch.cat(local) if local else torch.zeros(0)), ppo)
    n_masked = 0
    for t, lw, w in zip(tokens.values(), log_w, weighed, strict=True):
        masked = w & (lw**2 >= cut)
        n_masked += int(masked.sum())
        t.valid = t.valid & ~masked
    return n_masked


def fresh_tokens_check(
    prox: torch.Tensor, behav: torch.Tensor, versions: torch.Tensor, version: int
) -> dict[str, float]:
    """Tokens generated by the very weights the trainer holds now: their behaviour log-prob
    must equal the proximal one. A gap means inference and training disagree (weights not
    loaded, a different dtype or kernel), which silently biases every update."""
    fresh = versions == version
    n = int(fresh.sum())
    gap = float((prox - behav)[fresh].abs().max()) if n else 0.0
    return {"train/fresh_tokens": float(n), "train/fresh_logprob_diff_max": gap}


# ---------------------------------------------------------------- the loss of a micro-batch


def minibatch_norm(
    tokens: dict[int, TokenTensors], share: Sequence[int], ppo: PPOConfig, dp: DataParallel
) -> float:
    """loss_agg's count over the whole minibatch (this rank's `share` of it), on all ranks:
    every micro-batch divides by it, so the summed gradient does not depend on the cut."""
    n_local = sum(objective.norm_count(tokens[i].valid, [len(tokens[i].mask)], ppo) for i in share)
    (n_norm,) = dp.all_reduce([n_local], "sum")
    return n_norm


@dataclass(frozen=True)
class PolicyLoss:
    """backend.forward_backward's loss_fn for one minibatch: objective.policy_loss of
    micro-batch k from theta's log-probs (and entropy), over the minibatch's count.

    The step's first minibatch runs on the proximal weights themselves (nothing is updated
    yet). With `own_prox` its detached log-probs are its proximal ones (no pass ran for
    it); the fresh-token check of those runs here, where the log-probs are (a pipeline's
    last stage)."""

    parts: list[list[TokenTensors]]  # per micro-batch, its sequences' tensors
    ppo: PPOConfig
    n_norm: float  # minibatch_norm
    first: bool  # the step's first minibatch: theta is the proximal policy
    own_prox: bool  # ... and its forward gives the proximal log-probs
    version: int | None  # the trainer's: its tokens get the fresh-token check (None: no check)
    v_now: int | None  # prox_approx: the proximal policy's version

    def __call__(
        self, k: int, logprobs: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mb = TokenTensors.cat(self.parts[k], logprobs.device)
        extra = self._proximal(mb, logprobs)
        loss, stats = objective.policy_loss(
            logprobs,
            mb.prox,
            mb.behav,
            mb.adv,
            mb.mask,
            [len(t.mask) for t in self.parts[k]],
            self.ppo,
            ref_logprobs=mb.ref,
            entropy=entropy,
            n_norm=max(self.n_norm, 1),
            valid=mb.valid,
        )
        return loss, {**stats, **extra, "loss/ppo": loss.item() / self.ppo.n_minibatches}

    def _proximal(self, mb: TokenTensors, logprobs: torch.Tensor) -> dict[str, float]:
        """mb.prox where theta's forward gives it (own_prox) or it is interpolated
        (prox_approx); the statistics only this forward can give: the fresh-token check,
        the approximation's gap."""
        on = mb.mask.bool()
        approx = self.ppo.prox_approx != "none"
        extra = {}
        if self.own_prox or (approx and self.first):  # theta is the proximal policy
            theta = torch.where(on, logprobs.detach(), 0.0)
            if self.own_prox:
                mb.prox = theta
            if self.version is not None:
                extra = fresh_tokens_check(theta, mb.behav, mb.versions, self.version)
        if approx:
            prox = objective.approx_proximal_logprobs(logprobs, mb.behav, mb.versions, self.v_now)
            mb.prox = torch.where(on, prox, 0.0)
            if self.first:
                gap = (mb.prox - logprobs.detach())[mb.valid].abs()
                extra["train/prox_approx_gap_max"] = float(gap.max()) if len(gap) else 0.0
        return extra


@dataclass(frozen=True)
class ValueLoss:
    """critic.forward_backward's loss_fn for one minibatch: objective.value_loss of
    micro-batch k, a token mean over the minibatch's generated tokens on all ranks (n_norm),
    whatever ppo.loss_agg: the critic regresses every token's return alike."""

    parts: list[list[TokenTensors]]  # per micro-batch, its sequences' tensors
    value_clip: float | None  # critic.value_clip
    n_norm: float  # the minibatch's generated tokens on all ranks

    def __call__(self, k: int, values: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        mb = TokenTensors.cat(self.parts[k], values.device)
        loss, stats = objective.value_loss(
            values, mb.old_values, mb.returns, mb.mask, self.value_clip, self.n_norm
        )
        return loss, {**stats, "critic/value_loss": loss.item()}
