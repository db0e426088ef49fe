"""Dynamic micro-batching (paper Algorithm 1): a minibatch of variable-length sequences is cut
into micro-batches under a token budget instead of a fixed count. Torch-free, so that the
planner (areal/planner/sim_trainer.py) counts a simulated step's micro-batches by the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence


def allocate_micro_batches(
    seqlens: Sequence[int], max_tokens_per_mb: int, min_n_mbs: int = 1
) -> list[list[int]]:
    """Indices of the sequences in each micro-batch.

    Algorithm 1: longest first, each sequence into the first micro-batch that still has
    room, else into a new one (first-fit decreasing). If that makes fewer than min_n_mbs
    micro-batches (data-parallel ranks must all run the same number), the fullest ones are
    split until there are min_n_mbs, or one sequence each. A sequence longer than the
    budget is a configuration error: no micro-batch could hold it.
    """
    if max_tokens_per_mb <= 0:
        raise ValueError("trainer.mb_spec.max_tokens_per_mb must be positive")
    longest = max(seqlens, default=0)
    if longest > max_tokens_per_mb:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds trainer.mb_spec.max_tokens_per_mb="
            f"{max_tokens_per_mb}: raise it to at least the prompt length plus "
            "rollout.max_new_tokens"
        )
    order = sorted(range(len(seqlens)), key=lambda i: -seqlens[i])
    mbs: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for j, load in enumerate(loads):
            if load + seqlens[i] <= max_tokens_per_mb:
                mbs[j].append(i)
                loads[j] += seqlens[i]
                break
        else:
            mbs.append([i])
            loads.append(seqlens[i])
    while len(mbs) < min(min_n_mbs, len(seqlens)):
        # Split the micro-batch with the most tokens; halves keep the budget.
        j = max((k for k in range(len(mbs)) if len(mbs[k]) > 1), key=lambda k: loads[k])
        half = mbs[j][1::2]
        mbs[j] = mbs[j][0::2]
        mbs.append(half)
        loads[j] = sum(seqlens[i] for i in mbs[j])
        loads.append(sum(seqlens[i] for i in half))
    return mbs
