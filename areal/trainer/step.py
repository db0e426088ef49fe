"""One training step as two public phases: `prepare` makes the batch ready (a StepBatch),
`ppo_update` trains on it; `train_step` is the two. The trainer's step
(trainer/worker.py's Trainer.step) and your loop over areal.build's Run (`run.next_batch()`,
`run.ppo_update(batch)`, `run.publish(...)`) call the same two.

batch of B*G trajectories
  prepare(backend, trajs, ...) -> StepBatch:
  0) _shard: the minibatches and this rank's share of each (batch_split), the tokens and
     rollout tensors of this rank's sequences (ppo_batch.TokenTensors)
  1) _proximal_pass: one no-grad forward with the weights at the start of the step
     (without a mask that needs them first, the first minibatch's own forward gives its
     share; with ppo.prox_approx none at all); _reference_pass: the reference policy's,
     with ppo.kl_coef; _value_pass: with a critic (ppo.adv_estimator=gae) its values V_old,
     one no-grad forward
  2) _advantages: rewards shaped, advantages (ppo.adv_estimator) over the whole batch (gae:
     from V_old, with the returns the critic learns)
  3) ppo_batch.valid_tokens: generated, kept by the behaviour weight's mask
     (ppo.behav_imp_weight_*) and by M2PO's mask over the batch
  ppo_update(backend, batch, critic) -> the step's statistics:
  4) for each of ppo.n_minibatches minibatches, in order:
       this rank's token-balanced share (all of it without data parallelism)
       -> dynamic micro-batches, as many on every rank
       -> backend.forward_backward(micro-batches, ppo_batch.PolicyLoss(...)): the loop
          calls the loss_fn, ppo.policy_loss / loss_agg's count of the whole minibatch on
          all ranks, per micro-batch
       -> backward -> gradients summed over ranks -> clip -> one optimizer step
       -> with a critic (_critic_update): the same micro-batches through it, the clipped
          value loss, its own backward and optimizer step (one forward and backward more
          per minibatch)
  5) _statistics: the statistics of the whole batch, on every rank

The backend (backend.TrainerBackend) runs the micro-batches: `forward` for the proximal
log-probs, `forward_backward(micro_batches, loss_fn)` for the updates; a plain loop
(batching.MicroBatchLoops), or a pipeline schedule whose last stage calls loss_fn. Either
way every rank gets the results (log-prob streams, or each micro-batch's loss statistics).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from areal import events
from areal.trainer import ppo_batch
from areal.trainer.backend import TrainerBackend
from areal.trainer.micro_batches import allocate_micro_batches
from areal.trainer.parallel import DataParallel
from areal.trainer.ppo_batch import TokenTensors
from areal.trainer.ppo_config import PPOConfig
from areal.trajectory import Trajectory, TrajectoryRef

if TYPE_CHECKING:  # transformers, which the critic imports, only where a critic is made
    from areal.trainer.critic import TorchCritic


_TOKEN_MEANS = (
    "loss/clipfrac",
    "loss/approx_kl",
    "loss/behav_weight_mean",
    "loss/kl_ref",
    "loss/entropy",
)
_COUNTS = (
    "loss/n_valid_tokens",
    "loss/n_capped_tokens",
    "loss/behav_weight_max",
    "loss/behav_log_weight_sq_sum",
    "loss/n_generated_tokens",
)
_FRESH = ("train/fresh_tokens", "train/fresh_logprob_diff_max")


def _accumulate(stats: dict[str, float], mb_stats: dict[str, float]) -> None:
    """Merge micro-batch statistics: token-weighted sums, summed counts, overall max."""
    for k, v in mb_stats.items():
        if k in _TOKEN_MEANS:
            stats[k] += v * mb_stats["loss/n_valid_tokens"]
        elif k.endswith("_max"):
            stats[k] = max(stats[k], v)
        else:
            stats[k] += v


def _micro_batches(
    seqs: Sequence[Sequence[int]], idx: list[int], max_tokens_per_mb: int, min_n_mbs: int
):
    return [
        [idx[k] for k in mb]
        for mb in allocate_micro_batches([len(seqs[i]) for i in idx], max_tokens_per_mb, min_n_mbs)
    ]


def _pick(values: Sequence, mbs: list[list[int]]) -> list[list]:
    """values[i] for the indices i of each micro-batch."""
    return [[values[i] for i in mb] for mb in mbs]


@torch.no_grad()
def proximal_logprobs(
    backend: TrainerBackend,
    seqs: Sequence[Sequence[int]],
    max_tokens_per_mb: int,
    starts: list[int] | None = None,
) -> list[torch.Tensor]:
    """Log-probs of every sequence under the current weights, one tensor per sequence
    (entries before starts[i] may be 0)."""
    result: list[torch.Tensor | None] = [None] * len(seqs)
    mbs = _micro_batches(seqs, list(range(len(seqs))), max_tokens_per_mb, 1)
    streams = backend.forward(_pick(seqs, mbs), None if starts is None else _pick(starts, mbs))
    for mb, stream in zip(mbs, streams, strict=True):
        for i, part in zip(mb, stream.split([len(seqs[i]) - 1 for i in mb]), strict=True):
            result[i] = part
    return result


def _equal_micro_batches(
    seqs: Sequence[Sequence[int]], share: list[int], spec: tuple[int, int], dp: DataParallel
) -> list[list[int]]:
    """Dynamic micro-batches of this rank's share, as many on every rank.

    Ranks with fewer micro-batches split theirs up to the largest count (min_n_mbs); a
    rank with too few sequences for that pads with empty ones, which run nothing and add
    nothing, so the collectives of all ranks stay in step.
    """
    max_tokens_per_mb, min_n_mbs = spec
    mbs = _micro_batches(seqs, share, max_tokens_per_mb, min_n_mbs)
    (n_mbs,) = dp.all_reduce([len(mbs)], "max")
    if len(mbs) < n_mbs:
        mbs = _micro_batches(seqs, share, max_tokens_per_mb, int(n_mbs))
        mbs += [[] for _ in range(int(n_mbs) - len(mbs))]
    return mbs


def batch_split(
    seqlens: Sequence[int], n_minibatches: int, seed: int, dp: DataParallel
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """The minibatches (over a fixed shuffle of the batch), this rank's token-balanced share
    of each, and all of this rank's sequences. A function of the lengths alone, so a rank
    knows which trajectories to fetch before it holds any (areal/data_plane.py)."""
    order = list(range(len(seqlens)))
    random.Random(seed).shuffle(order)
    minibatches = [order[k::n_minibatches] for k in range(n_minibatches)]
    shares = [dp.share(mb, seqlens) for mb in minibatches]
    mine = sorted({i for share in shares for i in share})
    return minibatches, shares, mine


@dataclass
class StepBatch:
    """One step's batch as this rank holds it, what `prepare` gives `ppo_update`: the step's
    settings, this rank's shard (the tokens of its own sequences only: with the pull data
    plane it has no others) with their per-token tensors filled in (TokenTensors: the
    passes, the advantages, the masks), and what prepare measured."""

    trajs: Sequence[Trajectory | TrajectoryRef]  # the whole batch, the same on every rank
    ppo: PPOConfig
    dp: DataParallel
    version: int | None  # the trainer's, before this step (None: no fresh-token check)
    max_tokens_per_mb: int
    min_n_mbs: int
    value_clip: float | None  # critic.value_clip (ppo.adv_estimator=gae)
    seqlens: list[int]  # per sequence of the batch: its prompt and output tokens
    starts: list[int]  # per sequence: the stream entry that predicts its first output token
    minibatches: list[list[int]]  # over a fixed shuffle of the batch
    shares: list[list[int]]  # this rank's token-balanced share of each minibatch
    seqs: dict[int, list[int]]  # this rank's sequences (index in the batch: token ids), sorted
    tokens: dict[int, TokenTensors]  # their per-token tensors, in the same order
    prox_seqs: list[int] = field(default_factory=list)  # those the proximal pass ran over
    masked: tuple[int, int, int] = (0, 0, 0)  # ppo_batch.valid_tokens' counts
    stats: dict[str, float] = field(default_factory=dict)  # rewards, pass times, the critic's

    @property
    def mine(self) -> list[int]:
        return list(self.seqs)


def _shard(
    trajs: Sequence[Trajectory | TrajectoryRef],
    ppo: PPOConfig,
    dp: DataParallel,
    seed: int,
    version: int | None,
    mb_spec: tuple[int, int],
    value_clip: float | None,
) -> StepBatch:
    """0) The data-parallel shard: minibatches over a fixed shuffle of the batch, each
    rank a token-balanced share of each, and the tokens and rollout tensors of this rank's
    sequences. mb_spec: (max_tokens_per_mb, min_n_mbs)."""
    seqlens = [t.n_prompt + t.n_output for t in trajs]
    minibatches, shares, mine = batch_split(seqlens, ppo.n_minibatches, seed, dp)
    return StepBatch(
        trajs=trajs,
        ppo=ppo,
        dp=dp,
        version=version,
        max_tokens_per_mb=mb_spec[0],
        min_n_mbs=mb_spec[1],
        value_clip=value_clip,
        seqlens=seqlens,
        # The loss reads each stream from its first generated token's prediction on.
        starts=[t.n_prompt - 1 for t in trajs],
        minibatches=minibatches,
        shares=shares,
        seqs={i: trajs[i].prompt_ids + trajs[i].output_ids for i in mine},
        tokens={i: TokenTensors.of(trajs[i]) for i in mine},
    )


def _logprobs(backend: TrainerBackend, batch: StepBatch, idx: list[int]) -> list[torch.Tensor]:
    """proximal_logprobs of this rank's sequences `idx` under the backend's weights."""
    return proximal_logprobs(
        backend,
        [batch.seqs[i] for i in idx],
        batch.max_tokens_per_mb,
        [batch.starts[i] for i in idx],
    )


def _first_forward_is_proximal(ppo: PPOConfig) -> bool:
    """Without a mask that needs them before the update, the first minibatch's forward runs
    on the very weights the proximal pass would: its log-probs, detached, are the proximal
    ones (one forward over 1/n_minibatches of the batch saved, the whole pass with one
    minibatch)."""
    masks_first = ppo.behav_mask_bounds() != (None, None) or ppo.m2po_tau is not None
    return ppo.use_decoupled_loss and ppo.prox_approx == "none" and not masks_first


def _proximal_pass(backend: TrainerBackend, batch: StepBatch) -> list[int]:
    """1) The proximal policy = the weights before this step's first update: its log-probs
    of this rank's sequences into TokenTensors.prox. Naive PPO uses the behaviour policy's
    in its place; prox_approx interpolates them in the loss instead (no pass at all); the
    first minibatch may get them from its own forward (_first_forward_is_proximal), and
    until then has the behaviour's. Returns the sequences of the pass."""
    ppo = batch.ppo
    rest: list[int] = []
    prox: dict[int, torch.Tensor] = {}
    if ppo.use_decoupled_loss and ppo.prox_approx == "none":
        first = set(batch.shares[0]) if _first_forward_is_proximal(ppo) else set()
        rest = [i for i in batch.mine if i not in first]
        if rest:
            # What the pass computes, for the planner's cost fit (areal/planner/calibrate.py).
            work = dict(tokens=sum(batch.seqlens[i] for i in rest), seqs=len(rest))
            with events.span("proximal", version=batch.version, **work):
                prox = dict(zip(rest, _logprobs(backend, batch, rest), strict=True))
    for i, t in batch.tokens.items():
        t.prox = torch.where(t.mask.bool(), prox.get(i, t.behav), 0.0)
    return rest


def _reference_pass(ref: TrainerBackend | None, batch: StepBatch) -> float:
    """1) The frozen reference policy's log-probs of this rank's sequences (ppo.kl_coef > 0)
    into TokenTensors.ref, the behaviour's off the generated tokens (a KL of 0 there).
    Returns the pass's seconds."""
    assert ref is not None, "ppo.kl_coef > 0 needs the reference policy (ref)"
    t0 = time.time()
    with events.span("reference", version=batch.version):
        ref_lps = _logprobs(ref, batch, batch.mine)
    t_ref = time.time() - t0
    for t, lp in zip(batch.tokens.values(), ref_lps, strict=True):
        t.ref = torch.where(t.mask.bool(), lp, t.behav)
    return t_ref


@torch.no_grad()
def _value_pass(critic: TorchCritic, batch: StepBatch) -> None:
    """1) The critic's values of this rank's sequences before any update (V_old: the values
    GAE uses and the value clip is centred on) into TokenTensors.old_values, 0 off the
    generated tokens."""
    seqs = batch.seqs
    mbs = _micro_batches(seqs, batch.mine, batch.max_tokens_per_mb, 1)
    streams = critic.forward(_pick(seqs, mbs), _pick(batch.starts, mbs))
    for mb, stream in zip(mbs, streams, strict=True):
        for i, part in zip(mb, stream.split([len(seqs[i]) - 1 for i in mb]), strict=True):
            t = batch.tokens[i]
            t.old_values = torch.where(t.mask.bool(), part, 0.0)


def _advantages(
    batch: StepBatch, max_new_tokens: int | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """2) Rewards shaped, then advantages over the whole batch (the same on every rank) into
    TokenTensors.adv (and .returns with a critic). Returns the rewards, the shaped rewards
    and the critic's statistics (gae)."""
    trajs, ppo, dp = batch.trajs, batch.ppo, batch.dp
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
    truncated = torch.tensor([t.finish_reason == "length" for t in trajs])
    shaped = ppo_batch.shaped_rewards(
        trajs, rewards, truncated, batch.tokens, ppo, dp, max_new_tokens
    )
    critic_stats = ppo_batch.advantages(
        trajs, batch.tokens, shaped, truncated, ppo, dp, max_new_tokens
    )
    return rewards, shaped, critic_stats


def _loss_sums(batch: StepBatch) -> dict[str, float]:
    """4) The loss statistics' sums at zero, with every key a micro-batch reports (every rank
    the same keys), and the fresh-token check of the proximal pass's sequences already in."""
    ppo = batch.ppo
    keys = ["loss/ppo", *_TOKEN_MEANS[:3], *_COUNTS]
    keys += ["loss/kl_ref"] if ppo.kl_coef > 0 and ppo.kl_in == "loss" else []
    keys += ["loss/entropy"] if ppo.entropy_coef > 0 else []
    if ppo.behav_imp_weight_mode == "truncate":
        keys += ["loss/behav_truncated_tokens", "loss/behav_truncated_seqs"]
    stats = dict.fromkeys(keys, 0.0)
    if ppo.use_decoupled_loss and batch.version is not None:
        stats.update(dict.fromkeys(_FRESH, 0.0))
        for i in batch.prox_seqs:
            t = batch.tokens[i]
            _accumulate(
                stats, ppo_batch.fresh_tokens_check(t.prox, t.behav, t.versions, batch.version)
            )
    if ppo.prox_approx != "none":
        stats["train/prox_approx_gap_max"] = 0.0
    return stats


def _approx_version(batch: StepBatch) -> int | None:
    """prox_approx: the proximal policy's version, the trainer's (None without
    prox_approx); without `version`, the newest of the batch's tokens."""
    if batch.ppo.prox_approx == "none":
        return None
    if batch.version is not None:
        return batch.version
    return max(max(t.version_max, 0) for t in batch.trajs)


def _critic_update(
    critic: TorchCritic, batch: StepBatch, mbs: list[list[int]], sums: dict[str, float]
) -> None:
    """4) One update of the critic on one minibatch (this rank's micro-batches `mbs`): the
    clipped value loss (ppo_batch.ValueLoss), backward, gradients summed over ranks, its own
    clip and optimizer step. Adds to `sums` the loss, the token-weighted clip fraction's sum
    and token count, the gradient norm and the update's count."""
    t_critic = time.time()
    n_local = sum(int(batch.tokens[i].mask.sum()) for mb in mbs for i in mb)
    (n_norm,) = batch.dp.all_reduce([n_local], "sum")
    loss_fn = ppo_batch.ValueLoss(_pick(batch.tokens, mbs), batch.value_clip, n_norm)
    out = {"critic/value_loss": 0.0, "critic/clipfrac": 0.0, "critic/n_tokens": 0.0}
    for mb_stats in critic.forward_backward(
        _pick(batch.seqs, mbs), loss_fn, _pick(batch.starts, mbs)
    ):
        out["critic/value_loss"] += mb_stats["critic/value_loss"]
        out["critic/clipfrac"] += mb_stats["critic/clipfrac"] * mb_stats["critic/n_tokens"]
        out["critic/n_tokens"] += mb_stats["critic/n_tokens"]
    critic.reduce_grads(batch.dp)
    out["critic/grad_norm"] = critic.optimizer_step()
    out["critic/n_updates"] = 1.0
    for k, v in out.items():
        sums[k] = sums.get(k, 0.0) + v
    events.record("critic_update", t_critic, time.time(), version=batch.version)


def prepare(
    backend: TrainerBackend,
    trajs: Sequence[Trajectory | TrajectoryRef],
    *,
    ppo: PPOConfig,
    max_tokens_per_mb: int,
    min_n_mbs: int = 1,
    seed: int = 0,
    dp: DataParallel | None = None,
    version: int | None = None,
    ref: TrainerBackend | None = None,
    max_new_tokens: int | None = None,
    critic: TorchCritic | None = None,
    value_clip: float | None = None,
) -> StepBatch:
    """0-3) The batch made ready for ppo_update: this rank's shard, the proximal, reference
    and value passes, the advantages, the masks.

    Every rank passes the same batch; only this rank's sequences (batch_split) need their
    tokens, the others may be TrajectoryRefs (the pull data plane). `version` (the trainer's,
    before this step) enables the check of fresh tokens' log-probs (train/fresh_*). `ref`:
    the frozen reference policy (ppo.kl_coef > 0); `max_new_tokens`:
    rollout.max_new_tokens (ppo.overlong_penalty); `critic`: the value model of
    ppo.adv_estimator=gae, updated once per minibatch with critic.value_clip `value_clip`.
    """
    dp = dp or DataParallel()
    if (ppo.adv_estimator == "gae") != (critic is not None):
        raise ValueError("ppo.adv_estimator=gae and a critic go together: pass both or neither")
    if max_new_tokens is not None:  # ExperimentConfig has filled them already
        ppo = ppo.with_lengths(max_new_tokens)
    batch = _shard(trajs, ppo, dp, seed, version, (max_tokens_per_mb, min_n_mbs), value_clip)
    batch.prox_seqs = _proximal_pass(backend, batch)
    t_ref = _reference_pass(ref, batch) if ppo.kl_coef > 0 else None
    if critic is not None:
        with events.span("values", version=version):
            _value_pass(critic, batch)
    rewards, shaped, critic_stats = _advantages(batch, max_new_tokens)
    batch.masked = ppo_batch.valid_tokens(batch.tokens, ppo, dp)
    stats = batch.stats
    stats["reward/mean"] = rewards.mean().item()
    if not torch.equal(shaped, rewards):
        stats["reward/shaped_mean"] = shaped.mean().item()
    if t_ref is not None:
        stats["time/reference_s"] = t_ref
    stats["train/n_tokens"] = float(sum(t.n_generated for t in trajs))
    stats.update(critic_stats)
    return batch


def ppo_update(
    backend: TrainerBackend, batch: StepBatch, critic: TorchCritic | None = None
) -> dict[str, float]:
    """4) The minibatch updates of a prepared batch, in order: for each, this rank's share
    as micro-batches through backend.forward_backward with the objective's loss_fn, the
    gradients summed over ranks, one optimizer step; with a critic (the one prepare was
    given), its update on the same micro-batches. 5) Returns the step's statistics, of the
    whole batch and the same on every rank."""
    ppo, dp = batch.ppo, batch.dp
    if (ppo.adv_estimator == "gae") != (critic is not None):
        raise ValueError("ppo_update takes the critic prepare took (ppo.adv_estimator=gae)")
    sums = _loss_sums(batch)
    v_now = _approx_version(batch)
    grad_norms: list[float] = []
    critic_sums: dict[str, float] = {}
    for m, (minibatch, share) in enumerate(zip(batch.minibatches, batch.shares, strict=True)):
        if not minibatch:
            continue
        t_update = time.time()  # the timeline's update span, to the optimizer step
        n_norm = ppo_batch.minibatch_norm(batch.tokens, share, ppo, dp)
        spec = (batch.max_tokens_per_mb, batch.min_n_mbs)
        # Empty micro-batches (padding for data parallelism) run nothing.
        mbs = [mb for mb in _equal_micro_batches(batch.seqs, share, spec, dp) if mb]
        loss_fn = ppo_batch.PolicyLoss(
            _pick(batch.tokens, mbs), ppo, n_norm, first=m == 0,
            own_prox=m == 0 and _first_forward_is_proximal(ppo), version=batch.version,
            v_now=v_now,
        )  # fmt: skip
        for mb_stats in backend.forward_backward(
            _pick(batch.seqs, mbs), loss_fn, _pick(batch.starts, mbs),
            with_entropy=ppo.entropy_coef > 0,
        ):  # fmt: skip
            _accumulate(sums, mb_stats)
        # Clipping and the step come after the sum over ranks: every rank applies the same
        # update to the same weights.
        backend.reduce_grads(dp)
        grad_norms.append(backend.optimizer_step())
        events.record(
            "update", t_update, time.time(), version=batch.version,
            tokens=sum(batch.seqlens[i] for i in share), seqs=len(share), mbs=len(mbs),
        )  # fmt: skip
        if critic is not None:
            _critic_update(critic, batch, mbs, critic_sums)
    stats = _statistics(batch, sums, grad_norms)
    if critic is not None:
        stats.update(_critic_summary(critic_sums, dp))
    return stats


def train_step(
    backend: TrainerBackend,
    trajs: Sequence[Trajectory | TrajectoryRef],
    *,
    critic: TorchCritic | None = None,
    **step_args: Any,
) -> dict[str, float]:
    """One PPO training step on the whole batch: prepare (its keyword arguments), then
    ppo_update; with dp, on this rank's share of it. The returned statistics are of the
    whole batch and the same on every rank."""
    return ppo_update(backend, prepare(backend, trajs, critic=critic, **step_args), critic)


def _statistics(
    batch: StepBatch, sums: dict[str, float], grad_norms: list[float]
) -> dict[str, float]:
    """5) The loss statistics of the whole batch from every rank's sums (and ppo_batch.
    valid_tokens' counts): token means over the valid tokens, M2PO's M2 before any mask as
    the mean of (log pi_prox/pi_behav)^2 over the generated tokens; the mean gradient norm;
    prepare's statistics."""
    n_behav_tokens, n_behav_seqs, n_m2po = batch.masked
    if batch.ppo.m2po_tau is not None:
        sums["loss/n_m2po_masked_tokens"] = float(n_m2po)
    # (generated tokens out of the loss: loss/n_capped_tokens, this mask's and M2PO's)
    sums["loss/behav_masked_tokens"] = float(n_behav_tokens)
    sums["loss/behav_masked_seqs"] = float(n_behav_seqs)
    stats = batch.dp.reduce_stats(sums)
    n_tok = max(stats["loss/n_valid_tokens"], 1.0)
    for k in _TOKEN_MEANS:
        if k in stats:
            stats[k] /= n_tok
    n_gen = stats.pop("loss/n_generated_tokens")
    stats["loss/behav_m2"] = stats.pop("loss/behav_log_weight_sq_sum") / max(n_gen, 1.0)
    stats["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
    stats.update(batch.stats)
    return stats


def _critic_summary(sums: dict[str, float], dp: DataParallel) -> dict:
    """5) The critic's update statistics of the step: the value loss and gradient norm as
    means over its updates (one per minibatch), the clip fraction over every generated
    token."""
    n_updates = max(sums.pop("critic/n_updates", 0.0), 1.0)
    grad_norm = sums.pop("critic/grad_norm", 0.0) / n_updates  # the same on every rank
    total = dp.reduce_stats(sums)
    n_tok = max(total.pop("critic/n_tokens", 0.0), 1.0)
    return {
        "critic/value_loss": total.get("critic/value_loss", 0.0) / n_updates,
        "critic/clipfrac": total.get("critic/clipfrac", 0.0) / n_tok,
        "critic/grad_norm": grad_norm,
    }
