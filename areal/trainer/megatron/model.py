"""A megatron-core GPTModel built from an HF Qwen2 config.json.

Qwen2 = SwiGLU MLP, bias on q/k/v only, RMSNorm, grouped-query attention, rotary
embeddings with the config's theta, tied or untied input/output embeddings. Anything else
(another architecture, sliding-window attention, rope scaling) is refused with the file
and key to blame: converting it silently would train a different model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from areal.trainer.backend import DTYPES
from areal.trainer.megatron import cuda_redirect

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig


@dataclass(frozen=True)
class Qwen2Shape:
    """The few numbers of an HF Qwen2 config that fix every tensor's shape."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    def padded_vocab(self, tp: int) -> int:
        """Vocab rounded up to a multiple of tp: each TP rank holds an equal slice."""
        return -(-self.vocab_size // tp) * tp


def read_hf_config(model_dir: str | Path) -> tuple[dict, Qwen2Shape]:
    """config.json of an HF Qwen2 directory and its shape; a clear error for anything else."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: model.path must be an HF model directory")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "qwen2" or archs not in ([], ["Qwen2ForCausalLM"]):
        raise ValueError(
            f"{path}: model_type={cfg.get('model_type')!r}, architectures={archs}: the megatron "
            "backend converts Qwen2ForCausalLM only; use trainer.backend=torch for other models"
        )
    if cfg.get("use_sliding_window"):
        raise ValueError(
            f"{path}: use_sliding_window=true is not supported by trainer.backend=megatron"
        )
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"{path}: rope scaling {rope} is not supported by the megatron backend")
    heads = cfg["num_attention_heads"]
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    shape = Qwen2Shape(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    return cfg, shape


def check_layout(shape: Qwen2Shape, tp: int, pp: int, source: str = "the model") -> None:
    """TP splits heads by KV group and PP splits whole layers: both must divide evenly."""
    if shape.num_kv_heads % tp or shape.num_heads % tp:
        raise ValueError(
            f"trainer.parallel.tp={tp} must divide the {shape.num_heads} attention heads and "
            f"{shape.num_kv_heads} key/value heads of {source}"
        )
    if shape.num_layers % pp:
        raise ValueError(
            f"trainer.parallel.pp={pp} must divide the {shape.num_layers} layers of {source}"
        )


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # absent, or present without a working CUDA build
        return False
    return torch.cuda.is_available()


def rotary(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Megatron's rotary embedding of t [s, b, heads, d] by freqs [s, 1, 1, d_rot]
    (rope_utils._apply_rotary_pos_emb_bshd, halves not interleaved), in fp32, in place of
    TransformerEngine's fused kernel where TE is absent: compiled, the eager version's six
    passes over q and k (slices, cat, products) are one.
    """
    assert not interleaved, "interleaved rotary embeddings are not Qwen2's"
    rot = freqs.shape[-1]
    x = t[..., :rot].float()
    x1, x2 = x.chunk(2, -1)
    out = (x * freqs.cos() + torch.cat((-x2, x1), -1) * freqs.sin()).to(t.dtype)
    return torch.cat((out, t[..., rot:]), -1) if rot < t.shape[-1] else out


def _provide_fused_rope() -> None:
    """Megatron's apply_rope_fusion calls rope_utils.fused_apply_rotary_pos_emb, which is
    TE's kernel when TE is installed and None otherwise: then a compiled `rotary`."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = torch.compile(rotary, dynamic=True)


def transformer_config(
    shape: Qwen2Shape, tp: int, pp: int, dtype: str, on_gpu: bool, fused: bool = True
) -> TransformerConfig:
    """Megatron's TransformerConfig for the Qwen2 shape. Weights are initialised on the CPU
    without a GPU. With `fused` on a GPU, SwiGLU (Megatron's own kernel, compiled by its
    jit_fuser = torch.compile) and the rotary embedding (TE's kernel, or a compiled `rotary`)
    each run as one kernel forward and one backward. On CPU every fusion is off: compiling
    costs more there than it saves."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fused = fused and on_gpu
    if fused:
        _provide_fused_rope()
    params_dtype = DTYPES[dtype]
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        bias_activation_fusion=fused,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=fused,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )


def build_gpt_model(
    shape: Qwen2Shape, tp: int, pp: int, dtype: str = "float32", fused: bool = True
) -> GPTModel:
    """This rank's GPTModel: its TP slice of its PP stage's layers.

    Needs megatron's model-parallel groups (parallel_state.initialize_model_parallel).
    With TransformerEngine on a GPU the TE layer spec (fused kernels, packed THD
    sequences); otherwise the local spec that runs on CPU, its core attention replaced by
    one that runs a packed stream per sequence (packed_attention.py) instead of a mask.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    check_layout(shape, tp, pp)
    on_gpu = torch.cuda.is_available()
    config = transformer_config(shape, tp, pp, dtype, on_gpu, fused)
    if has_transformer_engine():
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        from areal.trainer.megatron.packed_attention import PackedDotProductAttention

        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    with cuda_redirect.cpu_tensors_stay():  # tied embeddings with pp > 1 (see cuda_redirect)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=shape.padded_vocab(tp),
            max_sequence_length=shape.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=True,  # logits stay vocab-parallel: log-probs via a TP reduction
            share_embeddings_and_output_weights=shape.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=shape.rope_theta,
        )
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    return model
