"""The objective's config: the `ppo` section, the paper recipes it starts from, and the two
models it may need (`ref_model` for ppo.kl_coef, `critic` for ppo.adv_estimator=gae).

    ppo.recipe --RECIPES--> the knobs a paper sets; a knob given explicitly wins; the rest
        keep the `areal` recipe's (_AREAL), and the derived ones follow (PPOConfig)
    PPOConfig.for_run(...)  the rules against the run's batch: group size, lengths, minibatches

The formulas are areal/trainer/ppo.py's (torch); this module is part of the config's schema
(areal/config.py holds it at `ppo`, `ref_model`, `critic`) and, like it, imports the standard
library and areal.config_loader only, never torch.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from areal.config_loader import ConfigError, Section

RECIPES: dict[str, dict[str, Any]] = {
    # The AReaL paper: decoupled PPO, batch-normalised advantages, token mean, no KL.
    "areal": {},
    # DeepSeekMath (Shao et al. 2024): group-normalised advantages, per-sequence token
    # mean, k3 KL to the reference in the loss (beta = 0.04).
    "grpo": dict(
        adv_estimator="grpo", loss_agg="seq_mean_token_mean", kl_coef=0.04, kl_estimator="k3"
    ),
    # Dr.GRPO (Liu et al. 2025): no std division, a constant length normaliser.
    "dr_grpo": dict(adv_estimator="dr_grpo", loss_agg="seq_mean_token_sum_norm"),
    # DAPO (Yu et al. 2025): clip-higher 0.28, token mean, soft overlong punishment,
    # dynamic sampling; no KL.
    "dapo": dict(
        adv_estimator="grpo",
        eps_clip_higher=0.28,
        loss_agg="token_mean",
        overlong_penalty=1.0,
        dynamic_sampling=True,
    ),
    # GSPO (Zheng et al. 2025, Qwen3): the length-normalised sequence ratio, clipped to
    # [1 - 3e-4, 1 + 4e-4], one term per sequence.
    "gspo": dict(
        adv_estimator="grpo",
        importance_sampling_level="sequence",
        eps_clip=3e-4,
        eps_clip_higher=4e-4,
        loss_agg="seq_mean_token_mean",
    ),
    # RLOO (Ahmadian et al. 2024): the leave-one-out baseline, per-sequence token mean.
    "rloo": dict(adv_estimator="rloo", loss_agg="seq_mean_token_mean"),
    # REINFORCE++ (Hu 2025): batch-normalised advantages, k2 KL in the reward, token mean.
    "reinforce_pp": dict(
        adv_estimator="reinforce_pp", kl_coef=0.01, kl_estimator="k2", kl_in="reward"
    ),
    # CISPO (MiniMax-M1, 2025): clipped stop-gradient IS weight times the log-prob, no lower
    # bound, token mean; zero-variance filtering (as ScaleRL, Khatri et al. 2025, runs CISPO;
    # here DAPO's form, which refills the batch): a CISPO step has no trust region, and on
    # a small model the groups it collapses onto one answer otherwise fill the batch with
    # zero advantages (docs/guides/objectives.md).
    "cispo": dict(
        adv_estimator="grpo", loss="cispo", eps_clip=1.0, eps_clip_higher=4.0, dynamic_sampling=True
    ),
    # M2PO (Zheng et al. 2025): the AReaL objective with the second-moment mask (tau 0.04),
    # over the tokens its authors' code weighs: those whose weight moved in their
    # advantage's direction, the rest keep the gradient that corrects their drift.
    "m2po": dict(adv_estimator="grpo", m2po_tau=0.04, m2po_tokens="trust_region"),
    # SAPO (Gao et al. 2025, Qwen): a sigmoid gate in place of the clip, temperatures 1.0 for
    # positive and 1.05 for negative advantages, group advantages, per-sequence token mean.
    "sapo": dict(
        adv_estimator="grpo",
        loss="sapo",
        sapo_tau_pos=1.0,
        sapo_tau_neg=1.05,
        loss_agg="seq_mean_token_mean",
    ),
    # PPO with a critic (Schulman et al. 2017; GAE: Schulman et al. 2016), the RLHF values
    # of InstructGPT (Ouyang et al. 2022), which OpenRLHF keeps as its defaults: gamma 1,
    # lambda 0.95, advantages whitened over the batch's tokens; the critic: `critic:`.
    "ppo": dict(adv_estimator="gae", gamma=1.0, lam=0.95),
    # The behaviour-weight corrections (w = pi_prox / pi_behav) on the AReaL objective:
    # TIS (Yao et al. 2025; slime --use-tis, verl rollout_is=token): w truncated at C = 2.
    "tis": dict(behav_imp_weight_mode="truncate", behav_imp_weight_cap=2.0),
    # MIS (Liu et al. 2025, "When Speed Kills Stability"; verl rollout_rs=sequence): whole
    # sequences whose product of w exceeds C = 2 leave the loss.
    "mis": dict(
        behav_imp_weight_mode="mask", behav_imp_weight_level="sequence", behav_imp_weight_cap=2.0
    ),
    # IcePop (Ling team 2025, Ring-1T; OpenRLHF icepop): tokens whose w leaves [0.5, 5]
    # leave the loss.
    "icepop": dict(
        behav_imp_weight_mode="mask", behav_imp_weight_floor=0.5, behav_imp_weight_cap=5.0
    ),
    # OpenRLHF seq-mask-tis: whole sequences whose geometric mean of w leaves [0.5, 5] leave
    # the loss; the others keep their tokens' own w.
    "seq_mask_tis": dict(
        behav_imp_weight_mode="mask",
        behav_imp_weight_level="geometric",
        behav_imp_weight_floor=0.5,
        behav_imp_weight_cap=5.0,
    ),
}
"""Recipe -> the knobs it sets; every other knob keeps the `areal` recipe's value (the
field defaults' `null` means "the recipe's"), and a knob given explicitly always wins."""

_AREAL = dict(
    eps_clip=0.2,
    loss="ppo",
    importance_sampling_level="token",
    adv_estimator="norm",
    loss_agg="token_mean",
    kl_coef=0.0,
    kl_estimator="k3",
    kl_in="loss",
    entropy_coef=0.0,
    overlong_penalty=0.0,
    mask_truncated=False,
    dynamic_sampling=False,
    cispo_mask=False,
    cispo_ratio="proximal",
    m2po_tokens="all",
    behav_imp_weight_mode="mask",
    behav_imp_weight_level="token",
)
"""The areal recipe's knobs; those left out stay null (off: c_clip, m2po_tau, the behaviour
weight's bounds, SAPO's temperatures; derived:
eps_clip_higher = eps_clip, and adv_norm, adv_std_norm = batch, true for adv_estimator=norm
and gae; gamma, lam = 1, 0.95 for adv_estimator=gae)."""
ADV_ESTIMATORS = (
    "norm", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_seq", "reinforce_pp_baseline",
    "gae",
)  # fmt: skip
TOKEN_ESTIMATORS = ("reinforce_pp", "gae")
"""Estimators whose advantage differs from token to token (areal/trainer/ppo.py
token_advantages); the others give every token its sequence's."""
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
_NORMED = ("norm", "gae")
"""Estimators whose advantages adv_norm and adv_std_norm normalise."""
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
"""Estimators whose baseline is the prompt's group: they need rollout.group_size >= 2."""


@dataclass(kw_only=True)
class PPOConfig(Section):
    """The objective: decoupled PPO (the paper) and the knobs of GRPO, Dr.GRPO, DAPO, GSPO,
    RLOO, REINFORCE++, CISPO, M2PO, SAPO and the behaviour-weight corrections (TIS, MIS,
    IcePop); areal/trainer/ppo.py has each knob's formula."""

    _section: ClassVar[str] = "ppo"

    recipe: str = "areal"
    """Sets the knobs below to a paper's values (RECIPES in areal/trainer/ppo_config.py): areal, grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp, cispo, m2po, sapo, ppo (with a critic), tis, mis, icepop, seq_mask_tis; a knob given explicitly wins."""  # noqa: E501
    use_decoupled_loss: bool = True
    """Decoupled objective (proximal policy apart from behaviour policy); false = naive PPO."""
    behav_imp_weight_mode: str | None = None
    """What happens to a behaviour weight w = pi_prox/pi_behav outside [behav_imp_weight_floor, behav_imp_weight_cap]: mask (the token, or its whole sequence, leaves the loss; the paper's cap) or truncate (w is clamped into the bounds: TIS)."""  # noqa: E501
    behav_imp_weight_level: str | None = None
    """What the bounds apply to: token (each token's w), sequence (the product of w over the sequence's tokens) or geometric (exp of the mean log w over them); ppo.py has the table."""  # noqa: E501
    behav_imp_weight_cap: float | None = None
    """Upper bound of the behaviour weight (> 1; null = none): the paper's cap with mode=mask, TIS's C with truncate."""  # noqa: E501
    behav_imp_weight_floor: float | None = None
    """Lower bound of the behaviour weight (in (0, 1); null = none): IcePop's 0.5."""
    n_minibatches: int = 4
    """Sequential PPO updates per training batch."""
    # ---- advantages (per sequence; null = the recipe's value) ----
    adv_estimator: str | None = None
    """norm (the paper: (r - mean) / std over adv_norm's set), grpo ((r - group mean) / group std), dr_grpo (r - group mean), rloo (r - mean of the group's others), reinforce_pp (the paper's: the return r - kl_coef * KL summed from each token on, whitened over every generated token of the batch), reinforce_pp_seq (one value per sequence, whitened over sequences), reinforce_pp_baseline (r - group mean, then batch-normalised), gae (PPO with a critic: GAE over each sequence's generated tokens with the critic's values, the `critic:` section; the per-token reward is the outcome at the last token, less kl_coef * KL per token with kl_in=reward)."""  # noqa: E501
    adv_norm: str | None = None
    """adv_estimator=norm: batch, group or none (no centring, no scaling); gae: batch (whitened over every generated token of the batch) or none; null = batch."""  # noqa: E501
    adv_std_norm: bool | None = None
    """adv_estimator=norm or gae: divide by the set's std; null = true."""
    gamma: float | None = None
    """adv_estimator=gae: the discount per generated token, in [0, 1]; null = 1 (the recipe's)."""
    lam: float | None = None
    """adv_estimator=gae: GAE's lambda, in [0, 1] (1: A = return - value; 0: the one-step TD error); null = 0.95."""  # noqa: E501
    reward_scale: float = 1.0
    """Rewards become (reward + reward_bias) * reward_scale before everything else."""
    reward_bias: float = 0.0
    """Added to every reward before reward_scale."""
    mask_truncated: bool | None = None
    """Samples cut at rollout.max_new_tokens (no EOS) get advantage 0 (DAPO's overlong filtering)."""  # noqa: E501
    overlong_penalty: float | None = None
    """DAPO's soft overlong punishment: an answer reaching into the last overlong_buffer tokens of rollout.max_new_tokens loses up to this much reward, linearly (0 = off)."""  # noqa: E501
    overlong_buffer: int | None = None
    """Tokens over which the overlong penalty grows from 0 to overlong_penalty; null = a fifth of rollout.max_new_tokens (DAPO's 4,096 of 20,480)."""  # noqa: E501
    dynamic_sampling: bool | None = None
    """DAPO: groups whose rewards are all equal are dropped before they reach a batch, and more are generated (rollout/dropped_groups)."""  # noqa: E501
    # ---- the ratio and its clip ----
    importance_sampling_level: str | None = None
    """token (PPO), sequence (GSPO: exp of the mean log-ratio over the sequence) or sequence_token (GSPO-token: that value, each token's own gradient)."""  # noqa: E501
    eps_clip: float | None = None
    """The clip range is [1 - eps_clip, 1 + eps_clip_higher]; the paper's 0.2 (1 = no lower bound)."""  # noqa: E501
    eps_clip_higher: float | None = None
    """Upper side of the clip range (DAPO's clip-higher); null = eps_clip."""
    c_clip: float | None = None
    """Dual clip: where A < 0 the objective is max(objective, c_clip * A); > 1, null = off."""
    loss: str | None = None
    """ppo (the clipped surrogate), cispo (clip(ratio) without gradient, times A times the log-prob) or sapo (a sigmoid gate of the ratio in place of the clip)."""  # noqa: E501
    cispo_mask: bool | None = None
    """loss=cispo: drop the gradient of tokens past the clip in their advantage's direction (A > 0 and u > 1 + eps_clip_higher, or A < 0 and u < 1 - eps_clip): MiniMax-M1's token mask M of its unified objective, PPO's trust region within CISPO."""  # noqa: E501
    cispo_ratio: str | None = None
    """loss=cispo: the ratio its clip bounds: proximal (u = pi_theta/pi_prox, the behaviour weight w = pi_prox/pi_behav outside the clip, as in every decoupled loss) or behaviour (w * u = pi_theta/pi_behav inside it: MiniMax-M1's r, whose clip then bounds a stale token's weight too)."""  # noqa: E501
    sapo_tau_pos: float | None = None
    """loss=sapo: the gate's temperature where A > 0 (the paper's 1.0; higher = sharper)."""
    sapo_tau_neg: float | None = None
    """loss=sapo: the gate's temperature where A <= 0 (the paper's 1.05)."""
    m2po_tau: float | None = None
    """M2PO: mask the tokens with the largest (log pi_prox/pi_behav)^2 until the batch's mean of it is <= tau (m2po_tokens says which tokens and how); null = off."""  # noqa: E501
    m2po_tokens: str | None = None
    """M2PO's cut: all (every valid token weighed; the largest removed until the mean of the rest is <= m2po_tau: the paper's mask as upstream AReaL applies it) or trust_region (only the tokens whose weight moved in their advantage's direction, A > 0 with w > 1 and A < 0 with w < 1, weighed and masked; the cut is the smallest m at which capping every m there brings their mean to m2po_tau: the M2PO authors' code)."""  # noqa: E501
    prox_approx: str = "none"
    """none (a forward pass computes the proximal log-probs) or loglinear (upstream AReaL's interpolation between the behaviour and current log-probs by version: no proximal pass)."""  # noqa: E501
    # ---- aggregation and regularisers ----
    loss_agg: str | None = None
    """token_mean (the paper), seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm (each sequence's sum / loss_agg_norm_len, Dr.GRPO)."""  # noqa: E501
    loss_agg_norm_len: int | None = None
    """The constant length of seq_mean_token_sum_norm; null = rollout.max_new_tokens."""
    kl_coef: float | None = None
    """Weight of the KL to the reference policy (ref_model); 0 = no reference model."""
    kl_estimator: str | None = None
    """k1 (log pi/pi_ref), k2 ((log pi/pi_ref)^2 / 2) or k3 (pi_ref/pi - 1 - log pi_ref/pi)."""
    kl_in: str | None = None
    """loss (+ kl_coef * KL, aggregated as the policy term) or reward (each sample's reward loses kl_coef * its summed KL under the behaviour policy)."""  # noqa: E501
    entropy_coef: float | None = None
    """Entropy bonus: - entropy_coef * H, aggregated as the policy term (torch backend)."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            self._fail("recipe", f"must be one of {', '.join(RECIPES)}; got {self.recipe!r}")
        for name, value in {**_AREAL, **RECIPES[self.recipe]}.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.adv_estimator in _NORMED:
            self.adv_norm = "batch" if self.adv_norm is None else self.adv_norm
            self.adv_std_norm = True if self.adv_std_norm is None else self.adv_std_norm
        if self.adv_estimator == "gae":
            self.gamma = 1.0 if self.gamma is None else self.gamma
            self.lam = 0.95 if self.lam is None else self.lam
        if self.eps_clip_higher is None:
            self.eps_clip_higher = self.eps_clip
        self._check_types()
        self._check_values()

    def _check_cispo(self) -> None:
        """CISPO's own knobs need loss=cispo."""
        if self.cispo_mask and self.loss != "cispo":
            self._fail("cispo_mask", f"is CISPO's token mask; loss={self.loss} (use loss=cispo)")
        self._one_of("cispo_ratio", ("proximal", "behaviour"))
        if self.cispo_ratio == "behaviour" and self.loss != "cispo":
            self._fail(
                "cispo_ratio", f"is CISPO's clipped ratio; loss={self.loss} (use loss=cispo)"
            )

    def _check_values(self) -> None:
        if not 0 < self.eps_clip <= 1:
            self._fail("eps_clip", f"must be in (0, 1], got {self.eps_clip!r} (0.2 is the paper's)")
        self._positive("eps_clip_higher")
        cap, floor = self.behav_imp_weight_cap, self.behav_imp_weight_floor
        if cap is not None and not cap > 1:
            # The ratio sits around 1, so a cap <= 1 would mask about half of all tokens.
            self._fail(
                "behav_imp_weight_cap",
                f"must be > 1 or null (no cap), got {cap!r}; public examples use 5.0 (2.0 for TIS)",
            )
        if floor is not None and not 0 < floor < 1:
            self._fail(
                "behav_imp_weight_floor",
                f"must be in (0, 1) or null (no lower bound), got {floor!r}; IcePop uses 0.5",
            )
        self._one_of("behav_imp_weight_mode", ("mask", "truncate"))
        self._one_of("behav_imp_weight_level", ("token", "sequence", "geometric"))
        self._positive("n_minibatches", "reward_scale")
        self._one_of("adv_estimator", ADV_ESTIMATORS)
        self._check_advantages()
        self._one_of("importance_sampling_level", ("token", "sequence", "sequence_token"))
        self._one_of("loss", ("ppo", "cispo", "sapo"))
        self._check_cispo()
        if self.loss == "sapo":
            if self.sapo_tau_pos is None or self.sapo_tau_neg is None:
                self._fail(
                    "loss",
                    "=sapo needs ppo.sapo_tau_pos and ppo.sapo_tau_neg (the paper's 1.0 and "
                    "1.05: ppo.recipe=sapo sets them)",
                )
            self._positive("sapo_tau_pos", "sapo_tau_neg")
        self._one_of("loss_agg", LOSS_AGGS)
        self._one_of("kl_estimator", ("k1", "k2", "k3"))
        self._one_of("kl_in", ("loss", "reward"))
        self._one_of("prox_approx", ("none", "loglinear"))
        self._non_negative("kl_coef", "entropy_coef", "overlong_penalty")
        if self.c_clip is not None:
            if not self.c_clip > 1:
                self._fail(
                    "c_clip", f"must be > 1 or null (off), got {self.c_clip!r}; 3.0 is usual"
                )
            if self.loss != "ppo":
                self._fail(
                    "c_clip", "is the dual clip of loss=ppo; CISPO's weight is clipped already"
                )
        if self.m2po_tau is not None:
            self._positive("m2po_tau")
        self._one_of("m2po_tokens", ("all", "trust_region"))
        if self.overlong_buffer is not None:
            self._positive("overlong_buffer")
        if self.loss_agg_norm_len is not None:
            self._positive("loss_agg_norm_len")
        self._check_prox_approx()

    def _check_advantages(self) -> None:
        """adv_norm, adv_std_norm, gamma and lam: each only where adv_estimator uses it."""
        if self.adv_estimator == "norm":
            self._one_of("adv_norm", ("batch", "group", "none"))
        elif self.adv_estimator == "gae":
            self._one_of("adv_norm", ("batch", "none"))  # per token: no group to take
        elif self.adv_norm is not None or self.adv_std_norm is not None:
            name = "adv_norm" if self.adv_norm is not None else "adv_std_norm"
            self._fail(
                name,
                f"applies to adv_estimator=norm only (and to gae's whitening); adv_estimator="
                f"{self.adv_estimator} "
                "fixes its own normalisation (leave it out, or use adv_estimator=norm)",
            )
        if self.adv_estimator == "gae":
            for name in ("gamma", "lam"):
                if not 0 <= getattr(self, name) <= 1:
                    self._fail(name, f"must be in [0, 1], got {getattr(self, name)!r}")
        elif self.gamma is not None or self.lam is not None:
            self._fail(
                "gamma" if self.gamma is not None else "lam",
                f"is GAE's (adv_estimator=gae, ppo.recipe=ppo); adv_estimator="
                f"{self.adv_estimator} has no critic (leave it out, or use adv_estimator=gae)",
            )

    def _check_prox_approx(self) -> None:
        """prox_approx needs the decoupled loss and no mask by the exact proximal policy."""
        if self.prox_approx == "none":
            return
        if not self.use_decoupled_loss:
            self._fail(
                "prox_approx",
                "approximates the decoupled loss's proximal policy: "
                "set ppo.use_decoupled_loss=true or prox_approx=none",
            )
        masks = ("behav_imp_weight_cap", "behav_imp_weight_floor", "m2po_tau")
        for name in masks if self.behav_imp_weight_mode == "mask" else masks[2:]:
            if getattr(self, name) is not None:
                self._fail(
                    "prox_approx",
                    f"cannot be combined with ppo.{name} (it masks by "
                    "the exact proximal log-probs before the update): use prox_approx=none"
                    " (or behav_imp_weight_mode=truncate)",
                )

    def behav_mask_bounds(self) -> tuple[float | None, float | None]:
        """(floor, cap) of the behaviour weight's mask; (None, None) when nothing is masked
        by it (no bounds, or mode=truncate)."""
        if self.behav_imp_weight_mode != "mask":
            return None, None
        return self.behav_imp_weight_floor, self.behav_imp_weight_cap

    def with_lengths(self, max_new_tokens: int) -> "PPOConfig":
        """This config with the lengths that default to rollout.max_new_tokens filled in:
        loss_agg_norm_len (= it) and overlong_buffer (a fifth of it)."""
        return dataclasses.replace(
            self,
            loss_agg_norm_len=self.loss_agg_norm_len or max_new_tokens,
            overlong_buffer=self.overlong_buffer or max(1, max_new_tokens // 5),
        )

    def for_run(
        self, *, group_size: int, max_new_tokens: int, batch_size: int, dp: int
    ) -> "PPOConfig":
        """This section checked against the run around it (rollout.group_size and
        max_new_tokens, trainer.batch_size, trainer.parallel.dp), with_lengths filled in."""
        if group_size < 2:
            uses = [
                f"ppo.{k}={v}"
                for k, v in (
                    ("adv_norm", self.adv_norm),
                    ("adv_estimator", self.adv_estimator),
                    ("dynamic_sampling", self.dynamic_sampling),
                )
                if v == "group" or v in GROUP_ESTIMATORS or v is True
            ]
            if uses:
                raise ConfigError(
                    f"{uses[0]} needs rollout.group_size >= 2 (a group of one has no spread "
                    "and no baseline); raise the group size or use ppo.adv_estimator=norm "
                    "with ppo.adv_norm=batch"
                )
        ppo = self.with_lengths(max_new_tokens)
        if ppo.overlong_penalty > 0 and ppo.overlong_buffer > max_new_tokens:
            raise ConfigError(
                f"ppo.overlong_buffer={ppo.overlong_buffer} exceeds rollout.max_new_tokens="
                f"{max_new_tokens}: the penalty grows over the last overlong_buffer tokens; "
                "lower it"
            )
        n_traj = batch_size * group_size
        if ppo.n_minibatches > n_traj:
            raise ConfigError(
                f"ppo.n_minibatches ({ppo.n_minibatches}) exceeds the "
                f"{n_traj} trajectories of a batch (trainer.batch_size x "
                "rollout.group_size): lower it or raise the batch"
            )
        if dp * ppo.n_minibatches > n_traj:
            # A rank without a sequence in a minibatch would only add an idle process.
            raise ConfigError(
                f"trainer.parallel.dp ({dp}) x ppo.n_minibatches ({ppo.n_minibatches}) "
                f"exceeds the {n_traj} trajectories of a batch: every rank needs a share of "
                "every minibatch; lower dp or n_minibatches, or raise the batch"
            )
        return ppo

    def summary(self) -> str:
        """The resolved objective in one line (the launcher prints it at start)."""
        ratio = {"token": "u", "sequence": "s_seq", "sequence_token": "s_seq(token grad)"}
        clip = f"clip [{1 - self.eps_clip:g}, {1 + self.eps_clip_higher:g}]"
        parts = [
            f"recipe={self.recipe}",
            "decoupled" if self.use_decoupled_loss else "naive",
            f"loss={self.loss}({ratio[self.importance_sampling_level]}, {clip}"
            + (f", dual {self.c_clip:g}" if self.c_clip else "")
            + ")",
            f"adv={self.adv_estimator}"
            + (
                f"[{self.adv_norm}{'' if self.adv_std_norm else ', no std'}]"
                if self.adv_estimator == "norm"
                else ""
            )
            + (
                f"[gamma={self.gamma:g}, lam={self.lam:g}, {self.adv_norm}"
                f"{'' if self.adv_std_norm else ', no std'}]"
                if self.adv_estimator == "gae"
                else ""
            ),
            f"agg={self.loss_agg}"
            + (f"/{self.loss_agg_norm_len}" if self.loss_agg == "seq_mean_token_sum_norm" else ""),
        ]
        if self.kl_coef:
            parts.append(f"kl={self.kl_coef:g}*{self.kl_estimator} in {self.kl_in}")
        if self.entropy_coef:
            parts.append(f"entropy={self.entropy_coef:g}")
        if self.m2po_tau is not None:
            parts.append(
                f"m2po_tau={self.m2po_tau:g}"
                + ("" if self.m2po_tokens == "all" else f" over {self.m2po_tokens}")
            )
        if self.loss == "sapo":
            parts.append(f"sapo_tau={self.sapo_tau_pos:g}/{self.sapo_tau_neg:g}")
        if (self.behav_imp_weight_cap, self.behav_imp_weight_floor) != (None, None):
            lo, hi = self.behav_imp_weight_floor, self.behav_imp_weight_cap
            parts.append(
                f"behav_{self.behav_imp_weight_mode}[{self.behav_imp_weight_level}]"
                f"=[{'-' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}]"
            )
        if self.prox_approx != "none":
            parts.append(f"prox_approx={self.prox_approx}")
        if self.overlong_penalty:
            parts.append(f"overlong={self.overlong_penalty:g} over {self.overlong_buffer} tokens")
        if self.mask_truncated:
            parts.append("mask_truncated")
        if self.dynamic_sampling:
            parts.append("dynamic_sampling")
        if (self.reward_bias, self.reward_scale) != (0.0, 1.0):
            parts.append(f"reward=(r{self.reward_bias:+g})*{self.reward_scale:g}")
        return " ".join(parts)


@dataclass(kw_only=True)
class RefModelConfig(Section):
    _section: ClassVar[str] = "ref_model"

    path: str = ""
    """HF model directory of the frozen reference policy (ppo.kl_coef > 0); empty = the policy's initial weights."""  # noqa: E501

    def __post_init__(self) -> None:
        self._check_types()


@dataclass(kw_only=True)
class CriticConfig(Section):
    _section: ClassVar[str] = "critic"

    path: str = ""
    """HF model directory of the value model's trunk; empty = the policy's initial weights (model.path). A scalar value head (a new linear layer on the final hidden state, zero at start) sits on it. Used with ppo.adv_estimator=gae (ppo.recipe=ppo) only."""  # noqa: E501
    lr: float | None = None
    """The critic's Adam learning rate (constant after the trainer's warm-up); null = trainer.lr."""
    weight_decay: float | None = None
    """The critic's AdamW weight decay; null = trainer.weight_decay."""
    betas: list[float] | None = None
    """The critic's Adam betas; null = trainer.betas."""
    adam_eps: float | None = None
    """The critic's Adam epsilon; null = trainer.adam_eps."""
    grad_clip: float | None = None
    """The critic's gradient-norm clip; null = trainer.grad_clip."""
    value_clip: float | None = 0.2
    """PPO's value clip eps: the loss is 0.5 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2) (OpenRLHF's 0.2); null = the plain 0.5 (V - R)^2."""  # noqa: E501

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("lr", "adam_eps", "grad_clip", "value_clip"):
            if getattr(self, name) is not None:
                self._positive(name)
        if self.weight_decay is not None:
            self._non_negative("weight_decay")
        if self.betas is not None and (
            len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas)
        ):
            self._fail(
                "betas", f"must be two numbers in [0, 1), got {self.betas!r}; e.g. [0.9, 0.95]"
            )
