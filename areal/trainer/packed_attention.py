"""Causal attention over a packed stream without a [T, T] mask: one batched SDPA call per
run of equal lengths, or per bucket of near-equal ones padded at their end, whichever a
cost model finds cheaper.

A packed micro-batch is one stream of T tokens holding n sequences (batching.pack_sequences).
A block-diagonal causal mask over the stream costs T^2 (memory and compute, forward and
backward); attention that runs each sequence on its own costs sum(L_i^2), and with
`is_causal=True` and no mask, torch's fused SDPA kernels (the flash kernel on CPU) keep
memory linear in L_i as well.

Sequences run in groups of consecutive ones, each group one SDPA call on [n, H, L, D]:

- a run of equal lengths is a view of its slice of the stream, no copy;
- a bucket of different lengths is padded to its longest at the END of each sequence (a
  row gather), and its valid rows taken back. Causal attention stays exact: a valid query
  never sees the padding after it, and the padded queries' outputs are dropped, so their
  gradients, and with them every gradient through the padding, are exactly zero.

`plan_groups` cuts the stream by dynamic programming over its runs with `AttentionCost`:
a call's fixed cost against what a bucket adds (the gathers, and L_max^2 for every member
instead of L_i^2). The micro-batches of the trainer come longest first
(micro_batches.allocate_micro_batches), so neighbours are near-equal and a sorted stream has
one run per distinct length.

Measured on the 2-core CPU (8 heads / 4 KV heads of 32 dims, forward + backward of
attention alone, one thread, CPU time): a 4,096-token micro-batch of 5 sequences takes
177 ms this way against 1,133 ms with the dense mask. A call costs ~0.08 ms and a bucket's
gathers ~0.5 us per padded position, while the flash kernel's work grows as L^2 from a few
dozen tokens on; so for near-equal lengths of any size the padding's extra squares and the
gathers cost more than the calls they save: 16 sequences of 80..88 tokens (9 runs) take
10.2 ms in runs against 11.0 ms as one bucket, 48 of them 28.7 against 32.5 ms, 16 of
144..152 tokens 24.5 against 25.9 ms. Buckets pay for short sequences of many lengths: 64
of 10..30 tokens 7.5 ms in runs, 6.7 ms as planned (the shortest in buckets); 64 distinct
lengths 10..73 20.0 against 18.5 ms. A long-tailed micro-batch (30 sequences of 10..1,500)
takes 106 ms in runs and 373 ms padded in buckets; the planner keeps it in runs. The runs
themselves are 4-14% faster than in the former code, which copied the output twice more.
In a whole
training step of the 4M-parameter model attention is under a tenth (the matrix products
three quarters), so a packed step beats a padded one by the tokens that padding wastes
(benchmarks/trainer.py). The alternatives were slower or absent on CPU: flex_attention has
no CPU backward in torch 2.13 (compiled or not), nested-tensor SDPA finds no CPU kernel
for training. The costs are CPU measurements; on a GPU, where a call's fixed cost is large
against its work, they under-use buckets (the GPU path is FlashAttention-2 varlen anyway
when it is installed: torch_backend.py).

`ATTN_IMPLEMENTATION` is registered with transformers' AttentionInterface and
AttentionMaskInterface; a model set to it (`model.set_attn_implementation`) takes the
sequence boundaries as the standard `cu_seq_lens_q` keyword of its forward (transformers
hands every extra forward keyword down to the attention function), or else reads them
from the restarting position ids. Its mask function builds no mask for a padding-free
forward, so nothing of size T^2 is ever made; with a padding mask or a KV cache both
functions hand over to transformers' SDPA, so the model stays usable as any other.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "areal_packed_sdpa"

# A bucket spans at most this many runs: bounds the planner's work (runs x this) on
# unsorted streams, where every sequence can be a run of its own.
MAX_RUNS_PER_BUCKET = 16


@dataclass(frozen=True)
class AttentionCost:
    """Microseconds of one layer's attention, forward + backward, as the planner counts them.

    Fitted on the 2-core CPU, one thread, 8 heads x 32 dims (4 KV heads); the terms marked
    "x width" scale with heads x head_dim / 256 (the work per position), the others do not.
    """

    call: float = 75.0  # one SDPA call: kernel entry, autograd node, the slice's views
    per_seq: float = 5.0  # each sequence (batch row) of a call
    per_token: float = 1.1  # each query position (x width)
    per_square: float = 0.05  # each position of the L x L square (x width)
    bucket: float = 60.0  # a bucket's four gathers and their scatters in the backward
    per_padded_token: float = 0.6  # each position those copy (x width)

    def group(self, n: int, length: int, width: float, padded: bool) -> float:
        """One call on n sequences of `length` (padded: gathered to it)."""
        per_position = self.per_token + self.per_square * length
        if padded:
            per_position += self.per_padded_token
        cost = self.call + n * (self.per_seq + width * length * per_position)
        return cost + self.bucket if padded else cost


COST = AttentionCost()


@dataclass(frozen=True)
class Group:
    """Consecutive sequences of the stream that share one SDPA call."""

    n_tokens: int  # its slice of the stream
    n: int  # sequences
    length: int  # the call's sequence length: all of theirs, or the longest
    index: torch.Tensor | None = None  # bucket: padded row -> row of the slice; None: a view
    keep: torch.Tensor | None = None  # bucket: the padded rows that are real


def _runs(lens: tuple[int, ...]) -> list[tuple[int, int]]:
    """(length, count) of each run of equal neighbours; empty sequences hold no tokens."""
    return [(length, len(list(g))) for length, g in itertools.groupby(lens) if length > 0]


def _bucket(runs: list[tuple[int, int]], device: str) -> Group:
    """A group of several runs, padded at each sequence's end to the longest."""
    lens = torch.tensor([length for length, count in runs for _ in range(count)])
    longest = int(lens.max())
    offsets = torch.cumsum(lens, 0) - lens
    pos = torch.arange(longest)
    valid = pos[None] < lens[:, None]  # [n, longest]
    # Padding rows copy their sequence's first token: finite values, and a zero gradient.
    index = torch.where(valid, offsets[:, None] + pos, offsets[:, None]).flatten()
    keep = valid.flatten().nonzero()[:, 0]
    return Group(int(lens.sum()), len(lens), longest, index.to(device), keep.to(device))


def _cut(runs: list[tuple[int, int]], width: float, cost: AttentionCost) -> list[int]:
    """Where the cheapest grouping of the runs starts each group (dynamic programming:
    best[j] is the cheapest cost of the first j runs)."""
    best = [0.0] + [math.inf] * len(runs)
    start = [0] * (len(runs) + 1)
    for j in range(1, len(runs) + 1):
        n, longest = 0, 0
        for i in range(j - 1, max(j - MAX_RUNS_PER_BUCKET, 0) - 1, -1):
            n += runs[i][1]
            longest = max(longest, runs[i][0])
            c = best[i] + cost.group(n, longest, width, padded=i < j - 1)
            if c < best[j]:
                best[j], start[j] = c, i
    cuts, j = [], len(runs)
    while j > 0:
        cuts.append(start[j])
        j = start[j]
    return cuts[::-1]


@functools.lru_cache(maxsize=64)
def plan_groups(
    lens: tuple[int, ...], width: float, cost: AttentionCost, device: str
) -> tuple[Group, ...]:
    """The groups of a stream of sequences of these lengths, in stream order. Cached: every
    layer of a forward (and its backward) asks for the same plan."""
    runs = _runs(lens)
    bounds = [*_cut(runs, width, cost), len(runs)]
    groups = []
    for i, j in itertools.pairwise(bounds):
        if j - i == 1:
            length, n = runs[i]
            groups.append(Group(length * n, n, length))
        else:
            groups.append(_bucket(runs[i:j], device))
    return tuple(groups)


def _group_attention(
    group: Group, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Causal SDPA of one group: its slice of the stream, token-major q [t, H, D] and k/v
    [t, H_kv, D] -> [t, H, D]."""
    if group.index is not None:
        q, k, v = (x.index_select(0, group.index) for x in (q, k, v))
    # [n, H, L, D] with token-major strides, the layout the fused kernels read and write.
    q, k, v = (x.unflatten(0, (group.n, group.length)).transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    o = o.transpose(1, 2).flatten(0, 1)  # a view: the kernels' output is token-major
    return o if group.keep is None else o.index_select(0, group.keep)


def causal_attention_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lens: list[int],
    scale: float | None = None,
    cost: AttentionCost | None = None,
) -> torch.Tensor:
    """Causal SDPA of each sequence of a packed stream: q [1, H, T, D], k/v [1, H_kv, T, D]
    -> [1, T, H, D] (token-major, as transformers' attention functions return it). lens
    are the sequence lengths in stream order (sum = T); `cost` defaults to COST."""
    assert query.shape[0] == 1 and sum(lens) == query.shape[2], (query.shape, sum(lens))
    heads, dim = query.shape[1], query.shape[3]
    groups = plan_groups(tuple(lens), heads * dim / 256, cost or COST, str(query.device))
    sizes = [g.n_tokens for g in groups]
    # Token-major views (transformers' q/k/v are [T, H, D] in memory). split, not slicing:
    # its backward concatenates the pieces' gradients in one pass.
    parts = (x.squeeze(0).transpose(0, 1).split(sizes) for x in (query, key, value))
    out = [_group_attention(g, q, k, v, scale) for g, q, k, v in zip(groups, *parts, strict=True)]
    return (torch.cat(out) if len(out) > 1 else out[0])[None]


def _lengths_from_positions(position_ids: torch.Tensor) -> list[int]:
    """Sequence lengths of one row of packed position ids: a sequence starts wherever the
    position does not follow on from the previous one (as transformers' packing detection)."""
    starts = torch.nonzero(torch.diff(position_ids) != 1)[:, 0] + 1
    bounds = [0, *starts.tolist(), len(position_ids)]
    return torch.diff(torch.tensor(bounds)).tolist()


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [B, H, T, D] -> ([B, T, H, D], None).

    The sequence boundaries come from cu_seq_lens_q (batch of one packed row), else from
    each row's position ids. Anything that is no packed training forward (a padding mask,
    a KV cache: fewer queries than keys) goes to transformers' own SDPA function unchanged.
    """
    if attention_mask is not None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION!r} has no sliding-window attention")
    assert dropout == 0.0, "attention dropout is not supported in the packed path"
    batch, _, length, _ = query.shape
    if cu_seq_lens_q is not None:
        assert batch == 1, "cu_seq_lens_q describes one packed row"
        rows = [torch.diff(cu_seq_lens_q).tolist()]
    elif position_ids is not None:
        rows = [_lengths_from_positions(p) for p in position_ids.expand(batch, -1)]
    else:
        rows = [[length]] * batch
    out = [
        causal_attention_packed(query[b : b + 1], key[b : b + 1], value[b : b + 1], lens, scaling)
        for b, lens in enumerate(rows)
    ]
    return (torch.cat(out) if batch > 1 else out[0]).contiguous(), None


def packed_sdpa_mask(
    *, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None, **kwargs: Any
) -> torch.Tensor | None:
    """The mask function under the same name: none at all for a padding-free forward without
    a cache (the attention function separates the sequences), else transformers' SDPA mask."""
    if attention_mask is None and q_length == kv_length:
        return None
    return sdpa_mask(
        q_length=q_length, kv_length=kv_length, attention_mask=attention_mask, **kwargs
    )


AttentionInterface.register(ATTN_IMPLEMENTATION, packed_sdpa_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, packed_sdpa_mask)
