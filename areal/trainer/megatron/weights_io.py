"""HF safetensors into this rank's Megatron shards, and all shards back out as HF files.

    load: every rank reads only the HF tensors of its own slices (shared storage), one at a time
    save: per PP stage, per parameter: all_gather over TP -> the stage's TP rank 0 converts
          -> send to global rank 0 (stage 0 is rank 0 itself) -> HFWriter, one shard at a time

Only the model-parallel group of data-parallel rank 0 saves: the other replicas hold the
same weights. The whole group must call `save_hf` together.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal.trainer.backend import DTYPES
from areal.trainer.megatron.convert import (
    HFReader,
    HFWriter,
    canonical,
    hf_shapes,
    hf_sources,
    stage_names,
    to_hf,
    to_megatron,
)
from areal.trainer.megatron.model import Qwen2Shape
from areal.weights import copy_companion_files

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {canonical(n): p for n, p in model.named_parameters()}


@torch.no_grad()
def load_hf(model: torch.nn.Module, model_dir: str | Path, shape: Qwen2Shape, layout: Any) -> None:
    """Copy this rank's slices of the HF checkpoint into `model` (a bare GPTModel)."""
    tp, tp_rank, pp, stage = layout
    reader = HFReader(model_dir, shape)
    params = _params(model)
    names = stage_names(shape, pp, stage)
    assert sorted(names) == sorted(params), (sorted(names), sorted(params))
    for name in names:
        hf = [reader.get(s) for s in hf_sources(name, shape, pp, stage)]
        value = to_megatron(name, hf, shape, tp, tp_rank)
        assert value.shape == params[name].shape, (name, value.shape, params[name].shape)
        params[name].copy_(value)


@torch.no_grad()
def save_hf(
    model: torch.nn.Module,
    out_dir: str | Path | None,
    shape: Qwen2Shape,
    layout: Any,
    source_dir: str | Path,
    dtype: torch.dtype,
) -> None:
    """Write the model as an HF directory at out_dir (global rank 0 writes; see module doc)."""
    writer = HFWriter(out_dir, dtype) if _is_writer() else None
    for k, v in hf_tensors(model, shape, layout):
        writer.add(k, v)
    if writer is not None:
        writer.close()
        _write_config(Path(out_dir), Path(source_dir), dtype)


def _is_writer() -> bool:
    return dist.get_rank() == 0 if dist.is_initialized() else True


def hf_tensors(
    model: torch.nn.Module, shape: Qwen2Shape, layout: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under their HF names, yielded on global rank 0 (nothing on the
    others); every rank of the trainer world must run it to the end (it gathers the tp
    slices and receives the later stages' tensors)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank, pp, stage = layout
    if ps.get_data_parallel_rank() != 0:
        return
    is_writer = _is_writer()
    assert not is_writer or (stage == 0 and tp_rank == 0)
    params = _params(model)
    expected = hf_shapes(shape)
    tp_group = ps.get_tensor_model_parallel_group()
    for s in range(pp):
        for name in stage_names(shape, pp, s):
            hf: dict[str, torch.Tensor] = {}
            if s == stage:
                local = params[name].detach()
                slices = [local]
                if tp > 1:
                    slices = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(slices, local.contiguous(), group=tp_group)
                if tp_rank == 0:
                    hf = to_hf(name, [x.cpu() for x in slices], shape, pp, s)
            if s == 0:
                if is_writer:
                    yield from hf.items()
                continue
            # Later stages stream each HF tensor to rank 0, in stage_names order on both sides.
            if s == stage and tp_rank == 0:
                for v in hf.values():
                    dist.send(v.to(params[name].device).contiguous(), dst=0)
            elif is_writer:
                dummy = {} if name == "output_layer.weight" and shape.tie_word_embeddings else None
                for k in hf_sources(name, shape, pp, s) if dummy is None else []:
                    buf = torch.empty(expected[k], dtype=params_dtype(model), device=_dev(model))
                    dist.recv(buf, src=_stage_rank0(s))
                    yield k, buf


def params_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _dev(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _stage_rank0(stage: int) -> int:
    """Global rank of (tp 0, dp 0) on a PP stage, asked by global rank 0 (tp 0, dp 0): its
    pipeline group holds exactly those ranks, in stage order."""
    from megatron.core import parallel_state as ps

    return dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[stage]


def _write_config(out: Path, source: Path, dtype: torch.dtype) -> None:
    """The source's config.json with the written dtype, and its tokenizer files."""
    cfg = json.loads((source / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = _DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    copy_companion_files(source, out)
