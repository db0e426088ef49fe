"""Every knob of the objective against a reference written from its paper's formula.

The references below are loops over sequences and tokens in float64, written from the
papers (PPO, DAPO, GSPO, CISPO, M2PO, SAPO, TIS, MIS, IcePop, GRPO, Dr.GRPO, RLOO,
REINFORCE++) and not from
areal/trainer/ppo.py's vectorised code; values and gradients must agree to 1e-6 on random
packed streams.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from areal.config import ConfigError, load_config
from areal.trainer.ppo import (
    ADV_EPS,
    approx_proximal_logprobs,
    compute_advantages,
    kl_estimate,
    m2po_cap,
    m2po_threshold,
    norm_count,
    policy_loss,
    shape_rewards,
    token_advantages,
    token_mask,
)
from areal.trainer.ppo_config import RECIPES, PPOConfig

TOL = 1e-6


# ---------------------------------------------------------------- random packed streams


def make_stream(seed: int, n_seqs: int = 6, stale: float = 0.3):
    """A packed stream of n_seqs sequences: theta, prox, behav log-probs near each other,
    per-sequence advantages of both signs, a loss mask with some prompt-like zeros."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 12, (n_seqs,), generator=g).tolist()
    n = sum(lens)
    prox = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.1
    theta = prox + 0.25 * torch.randn(n, generator=g, dtype=torch.float64)
    behav = prox + stale * torch.randn(n, generator=g, dtype=torch.float64)
    ref = prox + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    entropy = torch.rand(n, generator=g, dtype=torch.float64) * 2
    adv_seq = torch.randn(n_seqs, generator=g, dtype=torch.float64)
    adv = torch.repeat_interleave(adv_seq, torch.tensor(lens))
    mask = torch.ones(n)
    start = 0
    for length in lens:  # the first one or two entries of each stream are the prompt's
        mask[start : start + int(torch.randint(0, 3, (1,), generator=g))] = 0
        start += length
    return dict(
        theta=theta, prox=prox, behav=behav, ref=ref, entropy=entropy, adv=adv, mask=mask, lens=lens
    )


def split(x, lens):
    return list(torch.split(x, lens))


# ---------------------------------------------------------------- the reference objective


def reference_loss(s, cfg: PPOConfig, theta: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The objective from the papers, one sequence and one token at a time."""
    lo, hi = 1 - cfg.eps_clip, 1 + cfg.eps_clip_higher
    seq_terms, n_seqs, n_tokens, total = [], 0, 0, 0.0
    for th, pr, be, rf, en, ad, va in zip(
        *(
            split(x, s["lens"])
            for x in (theta, s["prox"], s["behav"], s["ref"], s["entropy"], s["adv"], valid)
        ),
        strict=True,
    ):
        idx = [t for t in range(len(th)) if va[t]]
        if not idx:
            continue
        n_seqs += 1
        n_tokens += len(idx)
        # GSPO: s_i = (prod_t pi/pi_old)^(1/|o_i|); its behaviour weight likewise.
        seq_log_ratio = sum(th[t] - pr[t] for t in idx) / len(idx)
        seq_log_w = sum(pr[t] - be[t] for t in idx) / len(idx)
        # TIS: the weight at the correction's level, truncated into [floor, cap].
        tis_w = {
            "token": {t: math.exp(pr[t] - be[t]) for t in idx},
            "sequence": dict.fromkeys(idx, math.prod(math.exp(pr[t] - be[t]) for t in idx)),
            "geometric": dict.fromkeys(idx, math.exp(seq_log_w)),
        }[cfg.behav_imp_weight_level]
        terms = []
        for t in idx:
            if cfg.importance_sampling_level == "token":
                ratio, w = torch.exp(th[t] - pr[t]), math.exp(pr[t] - be[t])
            elif cfg.importance_sampling_level == "sequence":
                ratio, w = torch.exp(seq_log_ratio), math.exp(seq_log_w)
            else:  # GSPO-token: sg[s_i] * pi(t) / sg[pi(t)]
                ratio = torch.exp(seq_log_ratio.detach()) * torch.exp(th[t] - th[t].detach())
                w = math.exp(seq_log_w)
            if cfg.behav_imp_weight_mode == "truncate":
                w = tis_w[t]
                if cfg.behav_imp_weight_cap is not None:
                    w = min(w, cfg.behav_imp_weight_cap)
                if cfg.behav_imp_weight_floor is not None:
                    w = max(w, cfg.behav_imp_weight_floor)
            a = ad[t]
            if cfg.loss == "cispo" and cfg.cispo_ratio == "behaviour":  # r = pi/pi_behav
                ratio, w = ratio * w, 1.0
            clipped = torch.clamp(ratio, lo, hi)
            if cfg.loss == "ppo":
                obj = torch.minimum(ratio * a, clipped * a)
                if cfg.c_clip is not None and a < 0:
                    obj = torch.maximum(obj, cfg.c_clip * a)
            elif cfg.loss == "cispo":  # sg[clip(r)] * A * log pi, times M (MiniMax's mask)
                obj = clipped.detach() * a * th[t]
                if cfg.cispo_mask and ((a > 0 and ratio > hi) or (a < 0 and ratio < lo)):
                    obj = obj.detach()
            else:  # SAPO: f(r) = 4 / tau * sigmoid(tau (r - 1)), tau by the sign of A
                tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
                obj = 4 / tau / (1 + torch.exp(-tau * (ratio - 1))) * a
            term = -w * obj
            if cfg.kl_coef and cfg.kl_in == "loss":
                log_r = th[t] - rf[t]
                kl = {
                    "k1": log_r,
                    "k2": 0.5 * log_r**2,
                    "k3": torch.exp(-log_r) - 1 + log_r,
                }[cfg.kl_estimator]
                term = term + cfg.kl_coef * kl
            if cfg.entropy_coef:
                term = term - cfg.entropy_coef * en[t]
            terms.append(term)
        seq_sum = sum(terms)
        total = total + seq_sum
        if cfg.loss_agg == "seq_mean_token_mean":
            seq_terms.append(seq_sum / len(idx))
        elif cfg.loss_agg == "seq_mean_token_sum":
            seq_terms.append(seq_sum)
        elif cfg.loss_agg == "seq_mean_token_sum_norm":
            seq_terms.append(seq_sum / cfg.loss_agg_norm_len)
    if cfg.loss_agg == "token_mean":
        return total / max(n_tokens, 1)
    return sum(seq_terms) / max(n_seqs, 1)


def reference_valid(s, cfg: PPOConfig) -> torch.Tensor:
    """Generated, within the behaviour weight's bounds (mask mode: the token's w, or its
    sequence's product or geometric mean over its generated tokens), and M2PO: drop the
    largest (log w)^2 one value at a time until the mean of the rest is <= tau."""
    valid = s["mask"].bool().clone()
    if cfg.behav_imp_weight_mode == "mask":
        lo = cfg.behav_imp_weight_floor or 0.0
        hi = cfg.behav_imp_weight_cap or math.inf
        start = 0
        for length in s["lens"]:
            gen = [t for t in range(start, start + length) if s["mask"][t]]
            ws = [math.exp(s["prox"][t] - s["behav"][t]) for t in gen]
            if cfg.behav_imp_weight_level == "token":
                keep = [lo <= w <= hi for w in ws]
            else:
                seq_w = math.prod(ws)
                if cfg.behav_imp_weight_level == "geometric":
                    seq_w = math.exp(sum(math.log(w) for w in ws) / max(len(ws), 1))
                keep = [lo <= seq_w <= hi] * len(ws)
            for t, k in zip(gen, keep, strict=True):
                valid[t] = bool(k)
            start += length
    if cfg.m2po_tau is not None and cfg.m2po_tokens == "all":
        m2 = (s["prox"] - s["behav"]) ** 2
        kept = [i for i in range(len(m2)) if valid[i]]
        while kept and sum(m2[i] for i in kept) / len(kept) > cfg.m2po_tau:
            top = max(m2[i] for i in kept)
            kept = [i for i in kept if m2[i] < top]
        valid = torch.zeros_like(valid)
        valid[kept] = True
    if cfg.m2po_tau is not None and cfg.m2po_tokens == "trust_region":
        valid = reference_m2po_trust_region(s, cfg, valid)
    return valid


def reference_m2po_trust_region(s, cfg: PPOConfig, valid: torch.Tensor) -> torch.Tensor:
    """M2PO as its authors' code cuts (Infini-AI-Lab/M2PO, kpo_clip_harmful_tokens): only
    the tokens whose log-ratio moved in their advantage's direction count; the smallest of
    their m = (log w)^2 at which capping all of them there brings the mean to tau is the cut;
    those at or above it are masked."""
    log_w = [float(p - b) for p, b in zip(s["prox"], s["behav"], strict=True)]
    moved = [
        i for i in range(len(log_w))
        if valid[i] and ((s["adv"][i] > 0 and log_w[i] > 0) or (s["adv"][i] < 0 and log_w[i] < 0))
    ]  # fmt: skip
    m2 = {i: log_w[i] ** 2 for i in moved}
    if not moved or sum(m2.values()) / len(moved) <= cfg.m2po_tau:
        return valid
    for c in sorted(m2.values()):
        if sum(min(v, c) for v in m2.values()) / len(moved) >= cfg.m2po_tau:
            break
    valid = valid.clone()
    for i in moved:
        valid[i] = m2[i] < c
    return valid


KNOBS = {
    "areal": {},
    "eps_clip": dict(eps_clip=0.1),
    "clip_higher": dict(eps_clip=0.2, eps_clip_higher=0.28),
    "dual_clip": dict(c_clip=1.5, eps_clip=0.05),
    "cispo": dict(loss="cispo", eps_clip=0.1, eps_clip_higher=0.15),
    "cispo_no_low": dict(loss="cispo", eps_clip=1.0, eps_clip_higher=0.1),
    "sequence": dict(importance_sampling_level="sequence", eps_clip=0.02),
    "sequence_token": dict(importance_sampling_level="sequence_token", eps_clip=0.02),
    "seq_mean_token_mean": dict(loss_agg="seq_mean_token_mean"),
    "seq_mean_token_sum": dict(loss_agg="seq_mean_token_sum"),
    "seq_mean_token_sum_norm": dict(loss_agg="seq_mean_token_sum_norm", loss_agg_norm_len=16),
    "kl_k1": dict(kl_coef=0.1, kl_estimator="k1"),
    "kl_k2": dict(kl_coef=0.1, kl_estimator="k2"),
    "kl_k3": dict(kl_coef=0.1, kl_estimator="k3", loss_agg="seq_mean_token_mean"),
    "entropy": dict(entropy_coef=0.01),
    "cap": dict(behav_imp_weight_cap=1.3),
    "mask_floor": dict(behav_imp_weight_floor=0.8),
    "mask_sequence": dict(behav_imp_weight_level="sequence", behav_imp_weight_cap=1.25),
    "mask_geometric": dict(
        behav_imp_weight_level="geometric", behav_imp_weight_floor=0.9, behav_imp_weight_cap=1.1
    ),
    "tis_token": dict(behav_imp_weight_mode="truncate", behav_imp_weight_cap=1.2),
    "tis_token_floor": dict(
        behav_imp_weight_mode="truncate", behav_imp_weight_floor=0.8, behav_imp_weight_cap=1.2
    ),
    "tis_sequence": dict(
        behav_imp_weight_mode="truncate",
        behav_imp_weight_level="sequence",
        behav_imp_weight_floor=0.5,
        behav_imp_weight_cap=1.5,
    ),  # fmt: skip
    "tis_geometric": dict(
        behav_imp_weight_mode="truncate",
        behav_imp_weight_level="geometric",
        behav_imp_weight_cap=1.05,
        loss_agg="seq_mean_token_mean",
    ),  # fmt: skip
    "tis_gspo": dict(
        behav_imp_weight_mode="truncate",
        behav_imp_weight_cap=1.1,
        importance_sampling_level="sequence",
        eps_clip=0.02,
    ),  # fmt: skip
    "sapo": dict(loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05),
    "sapo_sharp": dict(loss="sapo", sapo_tau_pos=3.0, sapo_tau_neg=5.0, c_clip=None),
    "sapo_recipe": dict(recipe="sapo"),
    "tis_recipe": dict(recipe="tis", behav_imp_weight_cap=1.2),
    "mis_recipe": dict(recipe="mis", behav_imp_weight_cap=1.25),
    "icepop_recipe": dict(recipe="icepop", behav_imp_weight_floor=0.8, behav_imp_weight_cap=1.25),
    "seq_mask_tis_recipe": dict(
        recipe="seq_mask_tis", behav_imp_weight_floor=0.9, behav_imp_weight_cap=1.1
    ),
    "mis_with_m2po": dict(recipe="mis", behav_imp_weight_cap=3.0, m2po_tau=0.03),
    "m2po": dict(m2po_tau=0.02),
    "m2po_trust_region": dict(m2po_tau=0.02, m2po_tokens="trust_region"),
    "m2po_trust_region_gspo": dict(
        m2po_tau=0.01, m2po_tokens="trust_region", importance_sampling_level="sequence"
    ),
    "gspo_recipe": dict(recipe="gspo", eps_clip=0.05, eps_clip_higher=0.06),
    "grpo_recipe": dict(recipe="grpo"),
    "dapo_recipe": dict(recipe="dapo"),
    "cispo_recipe": dict(recipe="cispo"),
    "cispo_mask": dict(loss="cispo", cispo_mask=True, eps_clip=0.1, eps_clip_higher=0.1),
    "cispo_sequence": dict(loss="cispo", importance_sampling_level="sequence", eps_clip=0.01),
    "cispo_behaviour": dict(
        loss="cispo", cispo_ratio="behaviour", cispo_mask=True, eps_clip=0.1, eps_clip_higher=0.1
    ),
    "cispo_behaviour_tis": dict(
        loss="cispo",
        cispo_ratio="behaviour",
        behav_imp_weight_mode="truncate",
        behav_imp_weight_cap=1.2,
    ),  # fmt: skip
    "everything": dict(
        c_clip=2.0,
        eps_clip_higher=0.3,
        importance_sampling_level="sequence_token",
        loss_agg="seq_mean_token_sum_norm",
        loss_agg_norm_len=10,
        kl_coef=0.05,
        kl_estimator="k2",
        entropy_coef=0.02,
        behav_imp_weight_cap=2.0,
        m2po_tau=0.05,
    ),
}


@pytest.mark.parametrize("name", list(KNOBS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_the_papers_formula(name, seed) -> None:
    cfg = PPOConfig(**{"loss_agg_norm_len": 12, **KNOBS[name]})
    s = make_stream(seed)
    theta = s["theta"].clone().requires_grad_(True)
    loss, stats = policy_loss(
        theta, s["prox"], s["behav"], s["adv"], s["mask"], s["lens"], cfg,
        ref_logprobs=s["ref"], entropy=s["entropy"],
    )  # fmt: skip
    loss.backward()
    valid = reference_valid(s, cfg)
    assert valid.sum() > 0
    theta_ref = s["theta"].clone().requires_grad_(True)
    expected = reference_loss(s, cfg, theta_ref, valid)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=TOL)
    assert (theta.grad - theta_ref.grad).abs().max().item() < TOL
    assert stats["loss/n_valid_tokens"] == valid.sum().item()
    assert theta.grad[~valid].abs().max().item() == 0.0  # masked tokens get no gradient
    # The correction acts on these streams (a case that changes nothing proves nothing).
    if cfg.behav_mask_bounds() != (None, None):
        assert stats["loss/n_capped_tokens"] > 0
    if cfg.behav_imp_weight_mode == "truncate":
        assert stats["loss/behav_truncated_tokens"] > 0


def test_truncation_counts_tokens_and_sequences() -> None:
    """TIS's statistics against a count by hand: tokens whose clamped weight differs, and the
    sequences holding one (at the sequence level, all tokens of a truncated sequence)."""
    s = make_stream(0)
    bounds = torch.tensor([0, *s["lens"]]).cumsum(0).tolist()
    for level in ("token", "sequence"):
        cfg = PPOConfig(behav_imp_weight_mode="truncate", behav_imp_weight_level=level,
                        behav_imp_weight_cap=1.2)  # fmt: skip
        _, stats = policy_loss(
            s["theta"], s["prox"], s["behav"], s["adv"], s["mask"], s["lens"], cfg
        )
        tokens = seqs = 0
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            gen = [t for t in range(a, b) if s["mask"][t]]
            ws = [math.exp(s["prox"][t] - s["behav"][t]) for t in gen]
            over = [w > 1.2 for w in ws] if level == "token" else [math.prod(ws) > 1.2] * len(ws)
            tokens += sum(over)
            seqs += any(over)
        assert (stats["loss/behav_truncated_tokens"], stats["loss/behav_truncated_seqs"]) == (
            tokens,
            seqs,
        )
        assert seqs > 0


def test_sapo_gate_is_smooth_and_matches_the_paper_at_known_points() -> None:
    """At u = 1 the gate's value is 2/tau and its slope 1 (PPO's there); far from 1 its
    gradient fades instead of stopping at a clip edge."""
    cfg = PPOConfig(loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    prox = torch.zeros(3, dtype=torch.float64)
    theta = torch.log(torch.tensor([1.0, 1.0, 3.0], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    loss, _ = policy_loss(theta, prox, prox, adv, torch.ones(3), [1, 1, 1], cfg)
    loss.backward()
    gate_far = 4 / (1 + math.exp(-2.0))  # u = 3, tau 1
    assert loss.item() == pytest.approx(-(2.0 - 1.0 + gate_far) / 3, abs=1e-12)
    # d/dtheta of 4/tau sigmoid(tau (u - 1)) A at u: 4 s (1 - s) u A, / 3 tokens, negated
    s_far = 1 / (1 + math.exp(-2.0))
    expected = [-1 / 3, 1 / 3, -4 * s_far * (1 - s_far) * 3 / 3]
    assert theta.grad.tolist() == pytest.approx(expected, abs=1e-12)


def test_knobs_change_the_loss() -> None:
    """Guard against a reference and an implementation that both ignore a knob."""
    s = make_stream(3)
    base = policy_loss(
        s["theta"], s["prox"], s["behav"], s["adv"], s["mask"], s["lens"], PPOConfig(),
        ref_logprobs=s["ref"], entropy=s["entropy"],
    )[0].item()  # fmt: skip
    for name, knobs in KNOBS.items():
        if name in ("areal", "grpo_recipe", "dapo_recipe"):
            continue  # these leave the areal objective's value on this stream
        cfg = PPOConfig(**{"loss_agg_norm_len": 12, **knobs})
        value = policy_loss(
            s["theta"], s["prox"], s["behav"], s["adv"], s["mask"], s["lens"], cfg,
            ref_logprobs=s["ref"], entropy=s["entropy"],
        )[0].item()  # fmt: skip
        assert abs(value - base) > 1e-6, name


@pytest.mark.parametrize(
    "loss_agg",
    ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"],
)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_every_aggregation_is_exact_under_any_split(loss_agg, level) -> None:
    """Micro-batches and data-parallel ranks each see some whole sequences; with the
    minibatch's count (norm_count summed) as n_norm, their losses and gradients sum to the
    whole stream's."""
    cfg = PPOConfig(
        loss_agg=loss_agg, loss_agg_norm_len=9, importance_sampling_level=level,
        kl_coef=0.1, entropy_coef=0.01, c_clip=3.0,
    )  # fmt: skip
    s = make_stream(5, n_seqs=9)
    whole_theta = s["theta"].clone().requires_grad_(True)
    args = (s["prox"], s["behav"], s["adv"], s["mask"])
    whole, _ = policy_loss(whole_theta, *args, s["lens"], cfg, s["ref"], s["entropy"])
    whole.backward()

    parts = [[0, 4, 7], [1, 2], [3, 5, 6, 8]]  # sequence indices of three "ranks"
    bounds = torch.tensor([0, *s["lens"]]).cumsum(0).tolist()

    def cut(x, seqs):
        return torch.cat([x[bounds[i] : bounds[i + 1]] for i in seqs])

    valid = token_mask(s["prox"], s["behav"], s["mask"], cfg)
    n_norm = sum(norm_count(cut(valid, p), [s["lens"][i] for i in p], cfg) for p in parts)
    theta = s["theta"].clone().requires_grad_(True)
    total = 0.0
    for p in parts:
        loss, _ = policy_loss(
            cut(theta, p), *(cut(x, p) for x in args), [s["lens"][i] for i in p], cfg,
            cut(s["ref"], p), cut(s["entropy"], p), n_norm=n_norm,
        )  # fmt: skip
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(whole.item(), abs=TOL)
    assert (theta.grad - whole_theta.grad).abs().max().item() < TOL


def test_nothing_valid_gives_zero_not_nan() -> None:
    s = make_stream(0)
    theta = s["theta"].clone().requires_grad_(True)
    for agg in ("token_mean", "seq_mean_token_mean"):
        cfg = PPOConfig(loss_agg=agg, importance_sampling_level="sequence")
        loss, _ = policy_loss(
            theta, s["prox"], s["behav"], s["adv"], torch.zeros_like(s["mask"]), s["lens"], cfg
        )
        loss.backward()
        assert loss.item() == 0.0 and not theta.grad.isnan().any()


def test_kl_estimators_on_known_values() -> None:
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log r = 0.5
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)


# ---------------------------------------------------------------- M2PO and prox_approx


def test_m2po_threshold_removes_the_largest_until_the_mean_fits() -> None:
    m = torch.tensor([0.0, 0.01, 0.02, 0.5, 0.9])
    # mean 0.286 > 0.04; without 0.9: 0.1325; without 0.5 too: 0.01 <= 0.04
    assert m2po_threshold(m, 0.04) == pytest.approx(0.5)
    assert m2po_threshold(m, 1.0) == math.inf  # nothing to remove
    # equal values go together: both 0.5s, not one of them
    assert m2po_threshold(torch.tensor([0.0, 0.5, 0.5]), 0.2) == pytest.approx(0.5)


def test_m2po_masks_only_the_outliers_of_a_stale_batch() -> None:
    s = make_stream(4, n_seqs=20, stale=0.1)
    s["behav"][[3, 17, 40]] -= 3.0  # three tokens sampled by a far older policy
    cfg = PPOConfig(m2po_tau=0.04)
    valid = token_mask(s["prox"], s["behav"], s["mask"], cfg)
    dropped = (s["mask"].bool() & ~valid).nonzero()[:, 0].tolist()
    assert {3, 17, 40} <= set(dropped) and len(dropped) < 10
    m2 = ((s["prox"] - s["behav"]) ** 2)[valid]
    assert m2.mean() <= 0.04


def test_m2po_cap_counts_the_capped_values_in_the_mean() -> None:
    m = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5], dtype=torch.float64)
    # removal: without 0.5 the mean is 0.25 <= 0.26, so the cut is 0.5. Capped at 0.4 the
    # sum is 1.0 + 0.4 = 1.4 >= 5 * 0.26, at 0.3 it is 0.6 + 0.3 * 2 = 1.2: the cut is 0.4
    assert m2po_threshold(m, 0.26) == pytest.approx(0.5)
    assert m2po_cap(m, 0.26) == pytest.approx(0.4)
    assert m2po_cap(m, 0.3) == math.inf  # the mean fits already
    assert m2po_cap(torch.tensor([0.3, 0.4]), 0.1) == pytest.approx(0.3)  # all above: all go


def test_m2po_trust_region_keeps_the_tokens_that_moved_against_their_advantage() -> None:
    """A drift toward a token the advantage punishes (A < 0, w > 1) is what its gradient
    corrects: the authors' cut keeps it, the all-token mask takes it out."""
    prox = torch.log(torch.tensor([0.9, 0.9, 0.5, 0.5], dtype=torch.float64))
    behav = torch.log(torch.tensor([0.1, 0.1, 0.5, 0.5], dtype=torch.float64))  # w = 9, 9, 1, 1
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(4)
    every = token_mask(prox, behav, mask, PPOConfig(m2po_tau=0.04), advantages=adv)
    assert every.tolist() == [False, False, True, True]
    moved = PPOConfig(m2po_tau=0.04, m2po_tokens="trust_region")
    kept = token_mask(prox, behav, mask, moved, advantages=adv)
    assert kept.tolist() == [True, False, True, True]


def test_prox_approx_interpolates_by_version() -> None:
    theta = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    behav = torch.tensor([-2.0, -2.0, -2.0, -2.0])
    versions = torch.tensor([5, 4, 3, 1])
    prox = approx_proximal_logprobs(theta, behav, versions, version=5)
    # alpha = (5 - v) / (6 - v): 0, 1/2, 2/3, 4/5
    expected = [-2.0, -1.5, -2.0 + 2 / 3, -2.0 + 0.8]
    assert prox.tolist() == pytest.approx(expected)
    assert not approx_proximal_logprobs(theta.requires_grad_(), behav, versions, 5).requires_grad


# ---------------------------------------------------------------- rewards and advantages


def group_stats(rewards, groups):
    by = {}
    for r, g in zip(rewards, groups, strict=True):
        by.setdefault(g, []).append(r)
    return by


REWARDS = [5.0, -5.0, 5.0, 5.0, -5.0, -5.0, -5.0, 1.0, 3.0, 0.0, 0.0, 2.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]


def reference_advantages(estimator: str) -> list[float]:
    r, by = REWARDS, group_stats(REWARDS, GROUPS)
    out = []
    for ri, g in zip(r, GROUPS, strict=True):
        mine = by[g]
        mean, std = statistics.fmean(mine), statistics.pstdev(mine)
        if estimator == "grpo":
            out.append((ri - mean) / (std + ADV_EPS))
        elif estimator == "dr_grpo":
            out.append(ri - mean)
        elif estimator == "rloo":
            out.append(ri - (sum(mine) - ri) / (len(mine) - 1))
        elif estimator in ("reinforce_pp_seq", "norm"):
            out.append((ri - statistics.fmean(r)) / (statistics.pstdev(r) + ADV_EPS))
        else:
            out.append(ri - mean)  # reinforce_pp_baseline: centred, then whitened below
    if estimator == "reinforce_pp_baseline":
        m, sd = statistics.fmean(out), statistics.pstdev(out)
        out = [(x - m) / (sd + ADV_EPS) for x in out]
    return out


@pytest.mark.parametrize(
    "estimator", ["norm", "grpo", "dr_grpo", "rloo", "reinforce_pp_seq", "reinforce_pp_baseline"]
)
def test_advantage_estimators_match_their_papers(estimator) -> None:
    adv = compute_advantages(
        torch.tensor(REWARDS), torch.tensor(GROUPS), PPOConfig(adv_estimator=estimator)
    )
    assert adv.tolist() == pytest.approx(reference_advantages(estimator), abs=1e-5)


def reference_reinforce_pp(rewards, masks, kls, kl_coef, truncated):
    """REINFORCE++ (Hu 2025): per-token reward -kl_coef * KL_t, the outcome reward at the
    end; A_t = the return from t (gamma 1), whitened over every generated token."""
    returns = []  # (sequence, position, G_t) of every generated token
    for i, (r, mask, kl) in enumerate(zip(rewards, masks, kls, strict=True)):
        gen = [t for t in range(len(mask)) if mask[t]]
        for t in gen:
            returns.append((i, t, r - kl_coef * sum(float(kl[s]) for s in gen if s >= t)))
    values = [g for _, _, g in returns]
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    out = [torch.zeros(len(m), dtype=torch.float64) for m in masks]
    for i, t, g in returns:
        out[i][t] = 0.0 if truncated[i] else (g - mean) / (std + ADV_EPS)
    return out


@pytest.mark.parametrize("kl_in", ["reward", "loss"])
def test_reinforce_pp_whitens_per_token_returns_over_the_batch(kl_in) -> None:
    """The per-token form: exact against the loop, any split of the sequences over ranks
    (sums added as the ranks' all-reduce would) gives the same, and it is not the
    sequence-level form (sequences of different lengths weigh by their tokens)."""
    g = torch.Generator().manual_seed(7)
    lens = [3, 9, 5, 12, 4, 7, 6, 10]
    masks = [torch.ones(n) for n in lens]
    for m in masks:
        m[: int(torch.randint(0, 3, (1,), generator=g))] = 0  # prompt-like positions
    kls = [torch.rand(n, generator=g, dtype=torch.float64) * 0.5 for n in lens]
    rewards = torch.randn(len(lens), generator=g, dtype=torch.float64) * 3
    truncated = torch.tensor([False, True, False, False, False, False, True, False])
    cfg = PPOConfig(recipe="reinforce_pp", kl_coef=0.2, kl_in=kl_in, mask_truncated=True)
    expected = reference_reinforce_pp(
        rewards.tolist(), masks, kls, 0.2 if kl_in == "reward" else 0.0, truncated.tolist()
    )
    whole = token_advantages(rewards, masks, cfg, kls=kls, truncated=truncated)
    for a, e in zip(whole, expected, strict=True):
        assert a.double().tolist() == pytest.approx(e.tolist(), abs=1e-6)

    # Two "ranks" holding [0, 3, 5] and the rest. A collective's result is the sum of
    # both ranks' arguments: run the ranks in rounds, each round learning one more sum.
    parts = [[0, 3, 5], [1, 2, 4, 6, 7]]
    known: list[list[float]] = []  # the sums over ranks of the collectives done so far
    while True:
        args, results = [], []
        for p in parts:
            calls = iter(range(100))

            def reduce(xs, calls=calls, args=args):
                j = next(calls)
                if j < len(known):
                    return known[j]
                if j == len(known):
                    args.append(xs)
                return xs  # not known yet: this round's result is discarded

            results.append(
                token_advantages(
                    rewards[p],
                    [masks[i] for i in p],
                    cfg,
                    kls=[kls[i] for i in p],
                    truncated=truncated[p],
                    sum_over_ranks=reduce,
                )  # fmt: skip
            )
        if not args:
            break
        known.append([sum(x) for x in zip(*args, strict=True)])
    assert len(known) == 2  # the mean, then the variance
    for p, got in zip(parts, results, strict=True):
        for i, a in zip(p, got, strict=True):
            assert a.double().tolist() == pytest.approx(expected[i].tolist(), abs=1e-6)
    # The sequence-level form gives each sequence one value: not this.
    seq = compute_advantages(rewards, None, PPOConfig(adv_estimator="reinforce_pp_seq"))
    assert any(
        abs(float(seq[i]) - float(whole[i][-1])) > 1e-3
        for i in range(len(lens))
        if not truncated[i]
    )


def test_norm_estimator_options() -> None:
    r, g = torch.tensor(REWARDS), torch.tensor(GROUPS)
    none = compute_advantages(r, g, PPOConfig(adv_norm="none"))
    assert none.tolist() == pytest.approx(REWARDS)
    no_std = compute_advantages(r, g, PPOConfig(adv_norm="batch", adv_std_norm=False))
    assert no_std.tolist() == pytest.approx([x - statistics.fmean(REWARDS) for x in REWARDS])
    group = compute_advantages(r, g, PPOConfig(adv_norm="group"))
    assert group.tolist() == pytest.approx(reference_advantages("grpo"), abs=1e-5)


def test_mask_truncated_zeroes_the_advantage_of_samples_without_eos() -> None:
    truncated = torch.tensor([i % 3 == 0 for i in range(len(REWARDS))])
    cfg = PPOConfig(adv_estimator="grpo", mask_truncated=True)
    adv = compute_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), cfg, truncated=truncated)
    expected = reference_advantages("grpo")
    for a, e, t in zip(adv.tolist(), expected, truncated.tolist(), strict=True):
        assert a == (0.0 if t else pytest.approx(e, abs=1e-5))


def test_reward_shaping_scale_bias_and_dapo_overlong_penalty() -> None:
    cfg = PPOConfig(reward_bias=1.0, reward_scale=0.5, overlong_penalty=2.0, overlong_buffer=4)
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([10, 16, 17, 18, 20])  # max_new_tokens 20: the buffer is 17..20
    shaped = shape_rewards(rewards, lengths, lengths == 20, cfg, max_new_tokens=20)
    # (1 + 1) * 0.5 = 1, minus 2 * clamp((L - 16) / 4, 0, 1)
    assert shaped.tolist() == pytest.approx([1.0, 1.0, 0.5, 0.0, -1.0])
    with pytest.raises(ValueError, match="max_new_tokens"):
        shape_rewards(rewards, lengths, lengths == 20, cfg)


# ---------------------------------------------------------------- recipes and the config


def test_each_recipe_sets_its_papers_values_and_explicit_knobs_win() -> None:
    for name, knobs in RECIPES.items():
        cfg = load_config(None, [f"ppo.recipe={name}"]).ppo
        for k, v in knobs.items():
            assert getattr(cfg, k) == v, (name, k)
        assert cfg.summary().startswith(f"recipe={name} ")
    dapo = load_config(None, ["ppo.recipe=dapo", "ppo.eps_clip_higher=0.3"]).ppo
    assert (dapo.eps_clip_higher, dapo.dynamic_sampling) == (0.3, True)
    default = load_config(None, []).ppo
    assert (default.adv_estimator, default.adv_norm, default.loss_agg) == (
        "norm", "batch", "token_mean"
    )  # fmt: skip
    assert (default.eps_clip, default.eps_clip_higher, default.kl_coef) == (0.2, 0.2, 0.0)


def test_lengths_default_to_max_new_tokens() -> None:
    cfg = load_config(None, ["ppo.recipe=dr_grpo", "rollout.max_new_tokens=40"])
    assert (cfg.ppo.loss_agg_norm_len, cfg.ppo.overlong_buffer) == (40, 8)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["ppo.recipe=ppo2"], ["ppo.recipe must be one of areal, grpo"]),
        (["ppo.recipe=grpo", "ppo.adv_norm=batch"], ["applies to adv_estimator=norm only"]),
        (["ppo.loss=cispo", "ppo.c_clip=3"], ["dual clip of loss=ppo"]),
        (["ppo.c_clip=0.5"], ["ppo.c_clip must be > 1"]),
        (["ppo.prox_approx=loglinear", "ppo.m2po_tau=0.04"], ["cannot be combined", "m2po_tau"]),
        (["ppo.prox_approx=loglinear", "ppo.use_decoupled_loss=false"], ["use_decoupled_loss"]),
        (["ppo.prox_approx=loglinear", "ppo.recipe=icepop"], ["behav_imp_weight_mode=truncate"]),
        (["ppo.behav_imp_weight_floor=1.5"], ["behav_imp_weight_floor must be in (0, 1)"]),
        (["ppo.behav_imp_weight_mode=clip"], ["mask, truncate"]),
        (["ppo.behav_imp_weight_level=seq"], ["token, sequence, geometric"]),
        (["ppo.loss=sapo"], ["ppo.recipe=sapo sets them"]),
        (["ppo.cispo_mask=true"], ["CISPO's token mask", "use loss=cispo"]),
        (["ppo.cispo_ratio=behaviour"], ["CISPO's clipped ratio", "use loss=cispo"]),
        (["ppo.recipe=cispo", "ppo.cispo_ratio=prox"], ["cispo_ratio", "proximal"]),
        (["ppo.recipe=sapo", "ppo.sapo_tau_neg=0"], ["sapo_tau_neg"]),
        (["ppo.recipe=grpo", "rollout.group_size=1"], ["needs rollout.group_size >= 2"]),
        (["ppo.importance_sampling_level=seq"], ["token, sequence, sequence_token"]),
        (["ppo.kl_estimator=k4"], ["k1, k2, k3"]),
        (["ppo.overlong_penalty=1", "ppo.overlong_buffer=9"], ["exceeds rollout.max_new_tokens"]),
        (["ppo.entropy_coef=0.01", "trainer.backend=megatron"], ["trainer.backend=torch"]),
    ],
)
def test_objective_config_mistakes_are_explained(overrides, words) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for w in words:
        assert w in str(e.value)
