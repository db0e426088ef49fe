"""One training step: proximal log-probs -> advantages -> minibatch updates.

batch of B*G trajectories
  1) proximal log-probs: one no-grad forward with the weights at the start of the step
  2) advantages: final reward, normalised over the batch (or per prompt group)
  3) for each of ppo.n_minibatches minibatches, in order:
       dynamic micro-batches -> decoupled PPO loss / valid tokens of the minibatch
       -> backward -> one optimizer step
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from areal.trainer.batching import allocate_micro_batches
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


def _accumulate(stats: dict[str, float], mb_stats: dict[str, float]) -> None:
    """Merge micro-batch statistics: token-weighted means, summed counts, overall max."""
    n = mb_stats["loss/n_valid_tokens"]
    for k, v in mb_stats.items():
        if k in _TOKEN_MEANS:
            stats[k] = stats.get(k, 0.0) + v * n
        elif k.endswith("_max"):
            stats[k] = max(stats.get(k, v), v)
        else:
            stats[k] = stats.get(k, 0.0) + v


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
) -> dict[str, float]:
    seqs = [t.prompt_ids + t.output_ids for t in trajs]
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    group_ids = torch.tensor([t.group_id for t in trajs]) if adv_norm == "group" else None
    advantages = compute_advantages(rewards, group_ids)
    tokens = _token_tensors(trajs, advantages)

    # 1) proximal policy = the weights before this step's first update. Naive PPO uses
    #    the behaviour policy in its place.
    if use_decoupled_loss:
        prox = proximal_logprobs(backend, seqs, max_tokens_per_mb)
    else:
        prox = [t["behav"] for t in tokens]
    for t, p in zip(tokens, prox, strict=True):
        t["prox"] = torch.where(t["mask"].bool(), p, torch.zeros_like(p))

    # 2) sequential minibatch updates over a fixed shuffle of the batch
    order = list(range(len(trajs)))
    random.Random(seed).shuffle(order)
    stats: dict[str, float] = {}
    grad_norms = []
    for mb_idx in range(n_minibatches):
        minibatch = order[mb_idx::n_minibatches]
        if not minibatch:
            continue
        n_valid = sum(
            behaviour_weight_mask(
                tokens[i]["prox"], tokens[i]["behav"], tokens[i]["mask"], behav_imp_weight_cap
            )
            .sum()
            .item()
            for i in minibatch
        )
        for mb in _micro_batches(seqs, minibatch, max_tokens_per_mb, min_n_mbs):
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
            stats["loss/ppo"] = stats.get("loss/ppo", 0.0) + loss.item() / n_minibatches
        grad_norms.append(backend.optimizer_step())

    n_tok = max(stats.get("loss/n_valid_tokens", 0.0), 1.0)
    for k in _TOKEN_MEANS:
        if k in stats:
            stats[k] /= n_tok
    stats["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
    stats["reward/mean"] = rewards.mean().item()
    stats["train/n_tokens"] = float(sum(len(t.output_ids) for t in trajs))
    return stats
