"""Padding-free packing of the micro-batches that micro_batches.allocate_micro_batches
(paper Algorithm 1) cuts: short sequences share a forward pass and no token is padding.
"""

from __future__ import annotations

import abc
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


class MicroBatchLoops(abc.ABC):
    """`forward` and `forward_backward` as plain loops over micro-batches (no pipeline
    stages), over a subclass's packed forward `stream`: the torch backend's log-probs, the
    critic's values, the megatron backend's log-probs with one stage. `forward_backward` is
    the loop itself, so the loss is one call below it (where a breakpoint goes).

    starts[k][i]: the first stream entry of micro-batch k's sequence i that the caller reads
    (the entries before it are 0).
    """

    @abc.abstractmethod
    def stream(
        self,
        seqs: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
        with_entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The stream of `seqs` packed into one forward, with gradients (L-1 entries per
        sequence of length L); with_entropy, also the per-token entropy stream."""

    def forward(
        self,
        micro_batches: Sequence[Sequence[Sequence[int]]],
        starts: Sequence[Sequence[int]] | None = None,
    ) -> list[torch.Tensor]:
        """Each micro-batch's stream, without gradients (float32, CPU)."""
        with torch.no_grad():
            return [
                self.stream(seqs, None if starts is None else starts[k]).float().cpu()
                for k, seqs in enumerate(micro_batches)
            ]

    def forward_backward(
        self,
        micro_batches: Sequence[Sequence[Sequence[int]]],
        loss_fn: LossFn,
        starts: Sequence[Sequence[int]] | None = None,
        with_entropy: bool = False,
    ) -> list[dict[str, float]]:
        """stream -> loss_fn(k, stream of micro-batch k) -> (loss, stats) -> loss.backward(),
        gradients accumulating; returns each micro-batch's stats. with_entropy: loss_fn
        gets the per-token entropy too (loss_fn(k, log-probs, entropy))."""
        results = []
        for k, seqs in enumerate(micro_batches):
            st = None if starts is None else starts[k]
            out = (
                self.stream(seqs, st, with_entropy=True)
                if with_entropy
                else (self.stream(seqs, st),)
            )
            loss, stats = loss_fn(k, *out)
            loss.backward()
            results.append(stats)
        return results
