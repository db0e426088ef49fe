"""Nested state (an optimizer's state_dict) saved as tensors apart from structure:
safetensors for the tensors and JSON for the rest, instead of pickle (areal/checkpoint.py).
A module of its own so that the launcher reads checkpoints without importing torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def _key(k: Any) -> Any:
    """A dict key as JSON: Megatron's optimizer state is keyed by ints and (dtype, dtype)."""
    if isinstance(k, torch.dtype):
        return {"__dtype__": str(k).removeprefix("torch.")}
    if isinstance(k, tuple):
        return {"__tuple__": [_key(x) for x in k]}
    return k


def _unkey(k: Any) -> Any:
    if isinstance(k, dict) and "__dtype__" in k:
        return getattr(torch, k["__dtype__"])
    if isinstance(k, dict) and "__tuple__" in k:
        return tuple(_unkey(x) for x in k["__tuple__"])
    return k


def _split(obj: Any, tensors: dict[str, torch.Tensor], prefix: str):
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        # JSON keys are strings: remember the int (and dtype) keys of optimizer state.
        return {
            "__dict__": [
                [_key(k), _split(v, tensors, f"{prefix}.{n}")]
                for n, (k, v) in enumerate(obj.items())
            ]
        }
    if isinstance(obj, (list, tuple)):
        return [_split(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, torch.dtype):
        return _key(obj)
    return obj


def _join(obj: Any, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, dict) and "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if isinstance(obj, dict) and "__dict__" in obj:
        return {_unkey(k): _join(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, dict) and "__dtype__" in obj:
        return _unkey(obj)
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    return obj


def save_tree(directory: Path, tensors_name: str, tree_name: str, state: dict) -> None:
    """`state` (nested dicts, lists, tensors, dtypes, JSON values) as tensors_name
    (safetensors) and tree_name (JSON: the structure, naming each tensor)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _split(state, tensors, "s")
    save_file(tensors, str(directory / tensors_name))
    (directory / tree_name).write_text(json.dumps(tree))


def load_tree(directory: Path, tensors_name: str, tree_name: str) -> dict:
    """What save_tree wrote."""
    tensors = load_file(str(directory / tensors_name))
    return _join(json.loads((directory / tree_name).read_text()), tensors)
