"""Causal attention over a packed stream, one SDPA call per sequence: no [T, T] mask.

A packed micro-batch is one stream of T tokens holding n sequences (batching.pack_sequences).
A block-diagonal causal mask over the stream costs T^2 (memory and compute, forward and
backward); attention that runs each sequence on its own costs sum(L_i^2), and with
`is_causal=True` and no mask, torch's fused SDPA kernels (the flash kernel on CPU) keep
memory linear in L_i as well.

Measured on the 2-core CPU (8 heads / 4 KV heads of 32 dims, forward + backward of
attention alone, one thread): a 4,096-token micro-batch of 5 sequences takes 180 ms this
way against 1,440 ms with the dense mask; 64 short sequences (T = 3,546) 33 ms. The
alternatives were slower or absent on CPU: flex_attention has no CPU backward in torch
2.13 (compiled or not), nested-tensor SDPA finds no CPU kernel for training, and
length-bucketed padding paid more in gathers than it saved in calls.

`ATTN_IMPLEMENTATION` is registered with transformers' AttentionInterface and
AttentionMaskInterface; a model set to it (`model.set_attn_implementation`) takes the
sequence boundaries as the standard `cu_seq_lens_q` keyword of its forward (transformers
hands every extra forward keyword down to the attention function), or else reads them
from the restarting position ids. Its mask function builds no mask for a padding-free
forward, so nothing of size T^2 is ever made; with a padding mask or a KV cache both
functions hand over to transformers' SDPA, so the model stays usable as any other.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "areal_packed_sdpa"


def causal_attention_per_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lens: list[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Causal SDPA of each sequence of a packed stream: q [1, H, T, D], k/v [1, H_kv, T, D]
    -> [1, H, T, D]. lens are the sequence lengths in stream order (sum = T).

    Neighbours of equal length (answers cut at max_new_tokens, a group's equal prompts and
    answers) share one batched call: a run of n sequences of length L is a [n, H, L, D] view
    of its slice of the stream, no copy."""
    assert query.shape[0] == 1 and sum(lens) == query.shape[2], (query.shape, sum(lens))
    runs = [(length, len(list(group))) for length, group in itertools.groupby(lens)]
    sizes = [length * n for length, n in runs]
    # split (not slicing): its backward concatenates the pieces' gradients in one pass,
    # where n slices would each add a full-size zero gradient (n * T work).
    parts = zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2), strict=True)
    gqa = query.shape[1] != key.shape[1]
    out = []
    for (length, n), (q, k, v) in zip(runs, parts, strict=True):
        q, k, v = (x[0].unflatten(1, (n, length)).transpose(0, 1) for x in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        out.append(o.transpose(0, 1).flatten(1, 2)[None])  # [1, H, n * L, D]
    return torch.cat(out, 2)


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
    out = torch.cat(
        [
            causal_attention_per_sequence(
                query[b : b + 1], key[b : b + 1], value[b : b + 1], lens, scaling
            )
            for b, lens in enumerate(rows)
        ]
    )
    return out.transpose(1, 2).contiguous(), None


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
