"""A KV-cached forward pass over a transformers decoder, for continuous batching on CPU.

```
 rows 0..n-1 of the cache = the decode engine's running requests, in row order
   prefill(row, tokens)   tokens -> K/V written at [0, len) of that row (causal SDPA)
   decode(tokens)         one token per row at position len(row): K/V appended, logits out
   move(srcs, dsts)       compaction when requests leave, so rows stay 0..n-1
   share(src, dsts, n)    rows dsts take row src's first n cached tokens (a shared prompt)
```

The layers are the model's own modules (projections, norms, rotary embedding, MLP), called
in the model's order; only attention and its cache are ours. So a weight update copied into
the model's parameters is what the next forward uses, and the logits equal a full
transformers forward up to float rounding (tests/unit/test_kv_cache.py).

Why not transformers' own caches: `DynamicCache`/`StaticCache` write one position per step
for the whole batch, but continuous batching needs each row at its own length; its
continuous-batching manager owns its own scheduler and thread, while the decode engine must decide
between steps what runs (pauses, aborts, weight versions), and it targets paged GPU kernels.
The cache is a tensor per layer, [rows, kv_heads, capacity, head_dim], sized by the decode
engine for the running requests' prompt + max_new_tokens within a budget of rows x capacity cells;
attention reads each chunk of neighbouring rows only up to its longest row (rows are placed
longest first when prefilled), so a decode step costs about the cells its rows hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areal.rollout.chunks import CHUNK_ROWS, attention_chunks, cells_read

# Decoder families whose layers this forward reproduces exactly: a pre-norm residual block of
# self-attention (rotary, optional q/k norms, GQA) and a gated MLP.
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


class KVCache:
    """The cached forward of one causal LM; only the decode thread may call it."""

    def __init__(self, model: torch.nn.Module, max_cells: int):
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the embedded engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models; "
                f"{config.model_type!r} is not one: serve it with inference.backend=sglang"
            )
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
            raise ValueError(
                "the embedded engine has no sliding-window attention; set "
                "use_sliding_window=false in the model's config.json or serve it with SGLang"
            )
        self.model = model
        self.layers = list(model.model.layers)
        attn = self.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.n_heads: int = config.num_attention_heads
        self.n_kv: int = config.num_key_value_heads
        self.scaling: float = attn.scaling
        self.max_cells = max_cells  # rows x capacity, the memory bound
        self.chunk_rows = CHUNK_ROWS  # rows per attention chunk (areal/rollout/chunks.py)
        self.read = 0  # cells the last decode step read (its chunks' rows x widths)
        self.lens: list[int] = []  # cached tokens of each live row
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._cos = self._sin = torch.empty(0)
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self._alloc(1, 1)

    # ---- rows -------------------------------------------------------------------------------

    @property
    def n_rows(self) -> int:
        return len(self.lens)

    def bytes_per_token(self) -> int:
        """Cache bytes that one token of one row takes (K and V, every layer)."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.n_kv * self.head_dim * itemsize

    def ensure(self, n_rows: int, length: int) -> None:
        """Rows 0..n_rows-1 (new ones empty), each with room for `length` tokens.

        The allocation is rows x capacity cells. It grows to the larger of what it has and
        what is asked while that stays within max_cells, else to exactly what is asked: the
        caller admits requests only while rows x longest fits the budget.
        """
        assert n_rows * length <= self.max_cells, (n_rows, length, self.max_cells)
        self.lens = self.lens[:n_rows] + [0] * (n_rows - len(self.lens))
        rows, cap = self._k[0].shape[0], self._k[0].shape[2]
        if n_rows <= rows and length <= cap:
            return
        rows, cap = max(rows, n_rows), max(cap, length)
        if rows * cap > self.max_cells:
            rows, cap = n_rows, length
        self._alloc(rows, cap)

    @torch.no_grad()
    def move(self, srcs: list[int], dsts: list[int]) -> None:
        """Copy rows srcs[i] into rows dsts[i], one indexed copy per cache tensor (a step
        where many requests leave costs 2 x layers copies, not that per moved row). No dst
        may be a src: the copies read every src before writing."""
        if not srcs:
            return
        assert not set(srcs) & set(dsts), (srcs, dsts)
        n = max(self.lens[s] for s in srcs)
        src, dst = torch.tensor(srcs, device=self.device), torch.tensor(dsts, device=self.device)
        for cache in (*self._k, *self._v):
            cache[dst, :, :n] = cache[src, :, :n]
        for s, d in zip(srcs, dsts, strict=True):
            self.lens[d] = self.lens[s]

    def reset(self, row: int) -> None:
        self.lens[row] = 0

    @torch.no_grad()
    def share(self, src: int, dsts: list[int], length: int) -> None:
        """Rows dsts take the first `length` cached tokens of row src: one index copy per
        cache tensor in place of a prefill (the answers of one prompt share its keys and
        values). No dst may be src."""
        assert src not in dsts and length <= self.lens[src], (src, dsts, length)
        dst = torch.tensor(dsts, device=self.device)
        for cache in (*self._k, *self._v):
            cache[dst, :, :length] = cache[src, :, :length]
        for d in dsts:
            self.lens[d] = length

    @torch.no_grad()
    def _alloc(self, rows: int, capacity: int) -> None:
        # zeros, not empty: a NaN bit pattern in an unwritten slot would poison softmax @ V
        # even at weight 0.
        shape = (rows, self.n_kv, capacity, self.head_dim)
        n, old_cap = self.n_rows, self._k[0].shape[2] if self._k else 0
        keep = min(old_cap, capacity)
        for caches in (self._k, self._v):
            for i in range(len(self.layers)):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(caches):
                    m = min(n, caches[i].shape[0])
                    new[:m, :, :keep] = caches[i][:m, :, :keep]
                    caches[i] = new
                else:
                    caches.append(new)
        self._rope(capacity)

    def _rope(self, length: int) -> None:
        """cos/sin of positions 0..length-1 from the model's own rotary module."""
        rotary = self.model.model.rotary_emb
        x = torch.empty(0, dtype=self.dtype, device=self.device)
        pos = torch.arange(length, device=self.device)[None]
        cos, sin = rotary(x, pos)
        self._cos, self._sin = cos[0], sin[0]  # [capacity, head_dim]

    # ---- forward passes -----------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, rows: list[int], seqs: list[list[int]]) -> None:
        """Cache the K/V of seqs[i] in rows[i] from position 0 (one right-padded batch)."""
        if not rows:
            return
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, device=self.device)
        index = torch.tensor(rows, device=self.device)
        cos, sin = self._cos[:width], self._sin[:width]  # [L, D]
        h = self.model.model.embed_tokens(ids)  # [B, L, H]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)  # [B, heads, L, D]
            self._k[li][index, :, :width] = k
            self._v[li][index, :, :width] = v
            # Right padding needs no mask: causality keeps every real token off the pads.
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scaling, enable_gqa=self.n_kv != self.n_heads
            )
            h = self._finish_layer(layer, h, out)
        for row, s in zip(rows, seqs, strict=True):
            self.lens[row] = len(s)

    @torch.no_grad()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens[r] to row r for every row; returns each row's next-token logits [n, V]."""
        n = len(tokens)
        assert n == self.n_rows
        lens = torch.tensor(self.lens, device=self.device)
        ids = torch.tensor(tokens, device=self.device)[:, None]  # [n, 1]
        cos, sin = self._cos[lens][:, None], self._sin[lens][:, None]  # [n, 1, D]
        rows = torch.arange(n, device=self.device)
        # (first row, end row, width, additive mask [rows, 1, 1, width]) of each chunk: a row
        # sees its cached tokens and the new one, positions <= its length (adding is cheaper
        # than masked_fill's broadcast on CPU).
        chunks = []
        layout = attention_chunks(self.lens, self.chunk_rows)
        self.read = cells_read(layout)
        for a, b, width in layout:
            hidden = torch.arange(width, device=self.device)[None] > lens[a:b, None]
            bias = torch.zeros(b - a, width, dtype=self.dtype, device=self.device)
            chunks.append((a, b, width, bias.masked_fill_(hidden, float("-inf"))[:, None, None]))
        group = self.n_heads // self.n_kv
        h = self.model.model.embed_tokens(ids)  # [n, 1, H]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos[:, None], sin[:, None])  # [n, heads, 1, D]
            self._k[li][rows, :, lens] = k[:, :, 0]
            self._v[li][rows, :, lens] = v[:, :, 0]
            # GQA without repeating K/V: the heads of one KV group share a matmul.
            qg = q.view(n, self.n_kv, group, self.head_dim) * self.scaling  # [n, kv, g, D]
            outs = []
            for a, b, width, bias in chunks:
                keys = self._k[li][a:b, :, :width]  # [rows, kv, W, D]
                values = self._v[li][a:b, :, :width]
                scores = torch.matmul(qg[a:b], keys.transpose(-1, -2)) + bias  # [rows, kv, g, W]
                probs = torch.softmax(scores.float(), -1).to(values.dtype)
                outs.append(torch.matmul(probs, values))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            h = self._finish_layer(layer, h, out.view(n, self.n_heads, 1, self.head_dim))
        self.lens = [length + 1 for length in self.lens]
        h = self.model.model.norm(h[:, 0])
        return self.model.lm_head(h)  # [n, V]

    def _qkv(self, layer: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed hidden states [B, L, H] -> rotated q, k and v, each [B, heads, L, D]."""
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (*x.shape[:2], -1, self.head_dim)
        q = attn.q_proj(x).view(shape)
        k = attn.k_proj(x).view(shape)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    @staticmethod
    def _finish_layer(
        layer: torch.nn.Module, h: torch.Tensor, attn_out: torch.Tensor
    ) -> torch.Tensor:
        """Attention output [B, heads, L, D] -> output projection, residual, MLP, residual."""
        b, _, length, _ = attn_out.shape
        h = h + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, length, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, as transformers applies it (rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
