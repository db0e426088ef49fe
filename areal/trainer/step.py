"""One training step: proximal log-probs -> advantages -> minibatch updates.

batch of B*G trajectories
  1) proximal log-probs: one no-grad forward with the weights at the start of the step
  2) advantages: final reward, normalised over the batch (or per prompt group)
  3) for each of ppo.n_minibatches minibatches, in order:
       this rank's token-balanced share (all of it without data parallelism)
       -> dynamic micro-batches, as many on every rank
       -> decoupled PPO loss / valid tokens of the whole minibatch on all ranks
       -> backward -> gradients summed over ranks -> clip -> one optimizer step
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from areal.trainer.batching import allocate_micro_batches
from areal.trainer.parallel import DataParallel
from areal.trainer.ppo import behaviour_weight_mask, compute_advantages, decoupled_ppo_loss
from areal.trajectory import Trajectory


def _token_tensors(trajs: Sequence[Trajectory], advantages: torch.Tensor):
    """Per-sequence tensors aligned with the backend's log-prob stream (L-1 entries each)."""
    out = []
    for traj, adv in zip(trajs, advantages, strict=True):
        n_prompt, n_out = len(traj.prompt_ids), len(traj.output_ids)
        length = n_prompt + n_out - 1
        mask = torch.zeros(length)
        mask[n_prompt - 1 :] = 1.0
        behav = torch.zeros(length)
        behav[n_prompt - 1 :] = torch.tensor(traj.logprobs, dtype=torch.float32)
        out.append({"mask": mask, "behav": behav, "adv": torch.full((length,), float(adv))})
    return out


_TOKEN_MEANS = ("loss/clipfrac", "loss/approx_kl", "loss/behav_weight_mean")
_COUNTS = ("loss/n_valid_tokens", "loss/n_capped_tokens", "loss/behav_weight_max")


def _accumulate(stats: dict[str, float], mb_stats: dict[str, float]) -> None:
    """Merge micro-batch statistics: token-weighted sums, summed counts, overall max."""
    n = mb_stats["loss/n_valid_tokens"]
    for k, v in mb_stats.items():
        if k in _TOKEN_MEANS:
            stats[k] += v * n
        elif k.endswith("_max"):
            stats[k] = max(stats[k], v)
        else:
            stats[k] += v


def _micro_batches(seqs, idx: list[int], max_tokens_per_mb: int, min_n_mbs: int):
    return [
        [idx[k] for k in mb]
        for mb in allocate_micro_batches([len(seqs[i]) for i in idx], max_tokens_per_mb, min_n_mbs)
    ]


@torch.no_grad()
def proximal_logprobs(backend, seqs, max_tokens_per_mb: int) -> list[torch.Tensor]:
    """Log-probs of every sequence under the current weights, one tensor per sequence."""
    result: list[torch.Tensor | None] = [None] * len(seqs)
    for mb in _micro_batches(seqs, list(range(len(seqs))), max_tokens_per_mb, 1):
        stream = backend.logprobs([seqs[i] for i in mb]).float().cpu()
        for i, part in zip(mb, stream.split([len(seqs[i]) - 1 for i in mb]), strict=True):
            result[i] = part
    return result


def _equal_micro_batches(seqs, share: list[int], spec: tuple[int, int], dp) -> list[list[int]]:
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


def train_step(
    backend,
    trajs: Sequence[Trajectory],
    *,
    eps_clip: float,
    use_decoupled_loss: bool,
    behav_imp_weight_cap: float | None,
    n_minibatches: int,
    adv_norm: str,
    max_tokens_per_mb: int,
    min_n_mbs: int = 1,
    seed: int = 0,
    dp: DataParallel | None = None,
) -> dict[str, float]:
    """One PPO training step on the whole batch; with dp, on this rank's share of it.

    Every rank passes the same batch. The returned statistics are of the whole batch and
    the same on every rank.
    """
    dp = dp or DataParallel()
    seqs = [t.prompt_ids + t.output_ids for t in trajs]
    seqlens = [len(s) for s in seqs]
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    group_ids = torch.tensor([t.group_id for t in trajs]) if adv_norm == "group" else None
    advantages = compute_advantages(rewards, group_ids)  # over the whole batch, on every rank
    tokens = _token_tensors(trajs, advantages)

    # Minibatches over a fixed shuffle of the batch; each rank takes a token-balanced share.
    order = list(range(len(trajs)))
    random.Random(seed).shuffle(order)
    minibatches = [order[k::n_minibatches] for k in range(n_minibatches)]
    shares = [dp.share(mb, seqlens) for mb in minibatches]
    mine = sorted({i for share in shares for i in share})

    # 1) proximal policy = the weights before this step's first update, for this rank's
    #    sequences only. Naive PPO uses the behaviour policy in its place.
    if use_decoupled_loss:
        prox = proximal_logprobs(backend, [seqs[i] for i in mine], max_tokens_per_mb)
        for i, p in zip(mine, prox, strict=True):
            tokens[i]["prox"] = p
    else:
        for i in mine:
            tokens[i]["prox"] = tokens[i]["behav"]
    for i in mine:
        t = tokens[i]
        t["prox"] = torch.where(t["mask"].bool(), t["prox"], torch.zeros_like(t["prox"]))

    # 2) sequential minibatch updates
    stats = dict.fromkeys(("loss/ppo", *_TOKEN_MEANS, *_COUNTS), 0.0)
    grad_norms = []
    for minibatch, share in zip(minibatches, shares, strict=True):
        if not minibatch:
            continue
        # The normaliser: valid tokens of the whole minibatch, over all ranks.
        n_local = sum(
            behaviour_weight_mask(
                tokens[i]["prox"], tokens[i]["behav"], tokens[i]["mask"], behav_imp_weight_cap
            )
            .sum()
            .item()
            for i in share
        )
        (n_valid,) = dp.all_reduce([n_local], "sum")
        for mb in _equal_micro_batches(seqs, share, (max_tokens_per_mb, min_n_mbs), dp):
            if not mb:
                continue
            logprobs = backend.logprobs([seqs[i] for i in mb])
            cat = {
                k: torch.cat([tokens[i][k] for i in mb]).to(logprobs.device)
                for k in ("mask", "behav", "adv", "prox")
            }
            loss, mb_stats = decoupled_ppo_loss(
                logprobs,
                cat["prox"],
                cat["behav"],
                cat["adv"],
                cat["mask"],
                eps_clip=eps_clip,
                behav_imp_weight_cap=behav_imp_weight_cap,
                n_valid_tokens=max(n_valid, 1),
            )
            loss.backward()
            _accumulate(stats, mb_stats)
            stats["loss/ppo"] += loss.item() / n_minibatches
        # Clipping and the step come after the sum over ranks: every rank applies the same
        # update to the same weights.
        dp.all_reduce_grads(backend.model.parameters())
        grad_norms.append(backend.optimizer_step())

    stats = dp.reduce_stats(stats)
    n_tok = max(stats["loss/n_valid_tokens"], 1.0)
    for k in _TOKEN_MEANS:
        stats[k] /= n_tok
    stats["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
    stats["reward/mean"] = rewards.mean().item()
    stats["train/n_tokens"] = float(sum(len(t.output_ids) for t in trajs))
    return stats
