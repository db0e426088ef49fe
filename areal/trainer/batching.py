"""Padding-free packing of the micro-batches that micro_batches.allocate_micro_batches
(paper Algorithm 1) cuts: short sequences share a forward pass and no token is padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def pack_sequences(
    seqs: Sequence[Sequence[int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate token lists into one stream: input_ids [T], position_ids [T], cu_seqlens [n+1].

    position_ids restart at 0 for every sequence; cu_seqlens marks where each one starts.
    """
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    cu_seqlens = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu_seqlens[1:] = torch.cumsum(lens, 0)
    input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    position_ids = torch.cat([torch.arange(n) for n in lens.tolist()]) if seqs else input_ids
    return input_ids, position_ids, cu_seqlens


def scored_rows(
    seqs: Sequence[Sequence[int]], starts: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(in_stream, scored), bool [T] over the packed stream of `seqs`: a token's next-token
    log-prob is in the log-prob stream unless it is its sequence's last (that one would
    predict the next sequence's first), and scored if it is also at or after its
    sequence's start (the entries before are 0)."""
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    position_ids = torch.cat([torch.arange(n) for n in lens.tolist()]) if seqs else lens
    first = torch.tensor(list(starts) if starts is not None else [0] * len(seqs), dtype=torch.long)
    in_stream = position_ids < torch.repeat_interleave(lens - 1, lens)
    return in_stream, in_stream & (position_ids >= torch.repeat_interleave(first, lens))


LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
"""loss_fn(k, log-prob stream of micro-batch k[, its per-token entropy]) -> (loss, stats)."""


def forward_loop(
    logprobs: Callable[[Sequence[Sequence[int]], Sequence[int] | None], torch.Tensor],
    micro_batches: Sequence[Sequence[Sequence[int]]],
    starts: Sequence[Sequence[int]] | None = None,
) -> list[torch.Tensor]:
    """The plain forward-only loop behind `backend.forward` (no pipeline stages): each
    micro-batch's log-prob stream, without gradients (float32, CPU).

    starts[k][i]: the first stream entry of micro-batch k's sequence i that the caller reads
    (the entries before it are 0).
    """
    with torch.no_grad():
        return [
            logprobs(seqs, None if starts is None else starts[k]).float().cpu()
            for k, seqs in enumerate(micro_batches)
        ]


def forward_backward_loop(
    logprobs: Callable[[Sequence[Sequence[int]], Sequence[int] | None], torch.Tensor],
    micro_batches: Sequence[Sequence[Sequence[int]]],
    loss_fn: LossFn,
    starts: Sequence[Sequence[int]] | None = None,
    with_entropy: bool = False,
) -> list[dict[str, float]]:
    """The plain micro-batch loop behind `backend.forward_backward` (no pipeline stages):
    log-probs -> loss_fn(k, log-probs of micro-batch k) -> (loss, stats) -> loss.backward(),
    gradients accumulating; returns each micro-batch's stats. `starts` as in forward_loop.
    with_entropy: `logprobs` takes with_entropy=True and returns (log-probs, entropy), and
    loss_fn gets both.
    """
    results = []
    for k, seqs in enumerate(micro_batches):
        st = None if starts is None else starts[k]
        out = logprobs(seqs, st, with_entropy=True) if with_entropy else (logprobs(seqs, st),)
        loss, stats = loss_fn(k, *out)
        loss.backward()
        results.append(stats)
    return results
