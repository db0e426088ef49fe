"""Megatron's local core attention for packed streams on CPU: per-sequence SDPA, no mask.

Megatron's local DotProductAttention needs an explicit [T, T] mask and materialises
[heads, T, T] scores; its THD packing needs TransformerEngine (GPU). This subclass takes
the sequence boundaries as Megatron's own PackedSeqParams (in the "sbhd" layout the local
spec uses), extended by their lengths on the host (PackedStream), and runs causal SDPA
per run of equal lengths or per padded bucket (areal.trainer.packed_attention): the cost
of a micro-batch is ~sum(L_i^2), not T^2.
Without PackedSeqParams it is DotProductAttention unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from areal.trainer.packed_attention import causal_attention_packed


@dataclass
class PackedStream(PackedSeqParams):
    """PackedSeqParams with the sequence lengths on the host as well: reading them from
    cu_seqlens in every layer would be a device-to-host copy each time, which stalls the
    host until the GPU has caught up (28 times a forward for a 1.5B Qwen2)."""

    lengths: tuple[int, ...] = ()


class PackedDotProductAttention(DotProductAttention):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """q [T, 1, heads, d], k/v [T, 1, kv heads, d] (this TP rank's) -> [T, 1, heads * d]."""
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )
        assert attention_mask is None and attention_bias is None, "a packed stream has no mask"
        assert isinstance(packed_seq_params, PackedStream), "pass a PackedStream"
        assert packed_seq_params.qkv_format == "sbhd" and query.shape[1] == 1
        lens = list(packed_seq_params.lengths)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [1, heads, T, d]
        out = causal_attention_packed(q, k, v, lens, self.softmax_scale)  # [1, T, heads, d]
        return out.reshape(query.shape[0], 1, -1)
