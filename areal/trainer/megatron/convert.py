"""HF Qwen2 <-> Megatron GPTModel weights: names, shapes, TP slices, PP stages.

Every Megatron tensor of a rank is a function of a few HF tensors, and every HF tensor a
function of the TP slices of one Megatron tensor on one PP stage, so conversion runs one
tensor at a time in both directions and never needs a whole model in one process:

    HF q,k,v [n*d, H]   -> linear_qkv [groups/tp * (q_per_group + 2) * d, H]  (per GQA group
                           its queries, then its key, then its value: Megatron's fused layout)
    HF gate, up [I, H]  -> linear_fc1 [2 * I/tp, H]      (this rank's gate rows, then up rows)
    HF o_proj, down     -> linear_proj, linear_fc2       (split along the input dim)
    embed / lm_head     -> word_embeddings / output_layer (vocab padded to a multiple of tp)
    norms               -> replicated

Names here are the local layer spec's; TransformerEngine's fused-norm names are mapped by
`canonical`. Layer indices are local to a PP stage: global = stage * layers_per_stage + local.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from areal.trainer.megatron.model import Qwen2Shape

HFGet = Callable[[str], torch.Tensor]

_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LAYER_HF = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    "self_attention.linear_qkv.weight": [f"self_attn.{x}_proj.weight" for x in "qkv"],
    "self_attention.linear_qkv.bias": [f"self_attn.{x}_proj.bias" for x in "qkv"],
    "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
}
_ROW_SPLIT = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")  # split dim 1
_REPLICATED = ("input_layernorm.weight", "pre_mlp_layernorm.weight", "final_layernorm.weight")


def canonical(name: str) -> str:
    """The local-spec name of a parameter of either layer spec."""
    for te, local in _TE_NAMES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def stage_names(shape: Qwen2Shape, pp: int, stage: int) -> list[str]:
    """Megatron parameter names (local spec) of one PP stage, in HF file order."""
    per_stage = shape.num_layers // pp
    names = ["embedding.word_embeddings.weight"] if stage == 0 else []
    for j in range(per_stage):
        names += [f"decoder.layers.{j}.{n}" for n in _LAYER_HF]
    if stage == pp - 1:
        names.append("decoder.final_layernorm.weight")
        # Tied embeddings: on one stage the output layer is the embedding itself; across
        # stages the last one holds a copy that Megatron keeps in sync.
        if not shape.tie_word_embeddings or pp > 1:
            names.append("output_layer.weight")
    return names


def hf_sources(name: str, shape: Qwen2Shape, pp: int, stage: int) -> list[str]:
    """The HF tensors a Megatron parameter is made of."""
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        return ["model.embed_tokens.weight" if shape.tie_word_embeddings else "lm_head.weight"]
    if name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    _, _, local, rest = name.split(".", 3)
    layer = stage * (shape.num_layers // pp) + int(local)
    return [f"model.layers.{layer}.{n}" for n in _LAYER_HF[rest]]


def hf_shapes(shape: Qwen2Shape) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF Qwen2 checkpoint of this shape must hold, with its shape."""
    h, d, i = shape.hidden_size, shape.head_dim, shape.intermediate_size
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    out = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for n in range(shape.num_layers):
        p = f"model.layers.{n}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
    out["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, h)
    return out


# ---- one tensor: HF -> this rank's slice ------------------------------------------------


def to_megatron(
    name: str, hf: list[torch.Tensor], shape: Qwen2Shape, tp: int, rank: int
) -> torch.Tensor:
    """This TP rank's slice of Megatron parameter `name` from its HF source tensors."""
    kind = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    if kind in _REPLICATED or kind.endswith("final_layernorm.weight"):
        return hf[0]
    if kind in ("embedding.word_embeddings.weight", "output_layer.weight"):
        (w,) = hf
        pad = shape.padded_vocab(tp) - shape.vocab_size
        w = torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w
        return w.chunk(tp)[rank]
    if kind.startswith("self_attention.linear_qkv."):
        g = shape.num_kv_heads
        q, k, v = (t.reshape(g, -1, *t.shape[1:]) for t in hf)  # [groups, rows, (H)]
        fused = torch.cat([q, k, v], dim=1)
        return fused.chunk(tp)[rank].reshape(-1, *fused.shape[2:])
    if kind == "mlp.linear_fc1.weight":
        gate, up = hf
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    assert kind in _ROW_SPLIT, name
    return hf[0].chunk(tp, dim=1)[rank]


# ---- one tensor: all TP slices -> HF ----------------------------------------------------


def to_hf(
    name: str, slices: list[torch.Tensor], shape: Qwen2Shape, pp: int, stage: int
) -> dict[str, torch.Tensor]:
    """The HF tensors of Megatron parameter `name` from its slices on TP ranks 0..tp-1."""
    sources = hf_sources(name, shape, pp, stage)
    kind = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    if kind in _REPLICATED or kind.endswith("final_layernorm.weight"):
        return {sources[0]: slices[0]}
    if kind in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name == "output_layer.weight" and shape.tie_word_embeddings:
            return {}  # the embedding is written once, from the first stage
        return {sources[0]: torch.cat(slices)[: shape.vocab_size]}
    if kind.startswith("self_attention.linear_qkv."):
        g, d = shape.num_kv_heads, shape.head_dim
        fused = torch.cat(slices).reshape(g, -1, *slices[0].shape[1:])
        q, k, v = fused.split([fused.shape[1] - 2 * d, d, d], dim=1)
        return {s: t.reshape(-1, *t.shape[2:]) for s, t in zip(sources, (q, k, v), strict=True)}
    if kind == "mlp.linear_fc1.weight":
        halves = [s.chunk(2) for s in slices]
        return {
            sources[0]: torch.cat([h[0] for h in halves]),
            sources[1]: torch.cat([h[1] for h in halves]),
        }
    assert kind in _ROW_SPLIT, name
    return {sources[0]: torch.cat(slices, dim=1)}


# ---- files ---------------------------------------------------------------------------


class HFReader:
    """Lazy access to the tensors of an HF directory (one file or an index of shards)."""

    def __init__(self, model_dir: str | Path, shape: Qwen2Shape):
        from safetensors import safe_open

        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            self.files = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with safe_open(single, "pt") as f:
                self.files = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise ValueError(
                f"{self.dir} has neither model.safetensors nor model.safetensors.index.json: "
                "save the model with safe_serialization=True"
            )
        self.expected = hf_shapes(shape)
        missing = sorted(set(self.expected) - set(self.files))
        if missing:
            raise ValueError(
                f"{self.dir}: tensor {missing[0]} is missing ({len(missing)} missing in all); "
                "is this a Qwen2 checkpoint matching config.json?"
            )
        for fname in sorted(set(self.files.values())):
            if not (self.dir / fname).is_file():
                raise ValueError(f"{self.dir / fname} is named in the index but does not exist")
        self._open: dict[str, object] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        fname = self.files[name]
        if fname not in self._open:
            self._open[fname] = safe_open(self.dir / fname, "pt")
        t = self._open[fname].get_tensor(name)
        if tuple(t.shape) != self.expected[name]:
            raise ValueError(
                f"{self.dir / fname}: tensor {name} has shape {tuple(t.shape)}, config.json "
                f"implies {self.expected[name]}"
            )
        return t


class HFWriter:
    """Writes tensors one by one into safetensors shards of at most max_shard_bytes.

    Only the current shard is held in memory. One shard is `model.safetensors`; more get
    `model-0000k-of-0000n.safetensors` names and a `model.safetensors.index.json`, as
    transformers and SGLang expect.
    """

    def __init__(self, out_dir: str | Path, dtype: torch.dtype, max_shard_bytes: int = 4 << 30):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype, self.max_shard_bytes = dtype, max_shard_bytes
        self._shard: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._written: list[tuple[str, list[str]]] = []  # (temporary file, tensor names)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu", self.dtype).contiguous()
        if self._shard and self._bytes + t.nbytes > self.max_shard_bytes:
            self._flush()
        self._shard[name] = t
        self._bytes += t.nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp = f"shard{len(self._written)}.tmp"
        save_file(self._shard, self.dir / tmp, metadata={"format": "pt"})
        self._written.append((tmp, list(self._shard)))
        self._shard, self._bytes = {}, 0

    def close(self) -> None:
        if self._shard or not self._written:
            self._flush()
        n = len(self._written)
        if n == 1:
            os.replace(self.dir / self._written[0][0], self.dir / "model.safetensors")
            return
        weight_map, total = {}, 0
        for k, (tmp, names) in enumerate(self._written):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / tmp, self.dir / final)
            weight_map.update(dict.fromkeys(names, final))
            total += (self.dir / final).stat().st_size
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def convert_state(
    hf: dict[str, torch.Tensor], shape: Qwen2Shape, tp: int, pp: int
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """A whole HF state dict as Megatron state dicts keyed by (pp stage, tp rank).
    For tests and tools; the trainer converts one tensor at a time."""
    return {
        (s, r): {
            n: to_megatron(n, [hf[x] for x in hf_sources(n, shape, pp, s)], shape, tp, r)
            for n in stage_names(shape, pp, s)
        }
        for s in range(pp)
        for r in range(tp)
    }


def merge_state(
    shards: dict[tuple[int, int], dict[str, torch.Tensor]], shape: Qwen2Shape, tp: int, pp: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of convert_state, one HF tensor at a time."""
    for s in range(pp):
        for n in stage_names(shape, pp, s):
            yield from to_hf(n, [shards[s, r][n] for r in range(tp)], shape, pp, s).items()
