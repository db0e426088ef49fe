"""Loading new weights into the live engine: every *.safetensors tensor of a directory,
checked name by name and shape by shape against the model before anything is copied."""

from __future__ import annotations

import collections
from pathlib import Path

import torch
from safetensors.torch import load_file


def load_checked(model: torch.nn.Module, model_path: str) -> dict[str, torch.Tensor]:
    """All tensors of model_path/*.safetensors, checked name by name against the model."""
    path = Path(model_path)
    if not path.is_dir():
        raise ValueError(f"model_path {model_path} is not a directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    expected = model.state_dict()
    problems = [f"unexpected tensor {name}" for name in sorted(set(tensors) - set(expected))]
    # Tied parameters (lm_head and embeddings) share storage: one of their names suffices.
    groups: dict[int, list[str]] = collections.defaultdict(list)
    for name, tensor in expected.items():
        groups[tensor.data_ptr()].append(name)
    problems += [
        f"missing tensor {names[0]}"
        for names in groups.values()
        if not any(name in tensors for name in names)
    ]
    problems += [
        f"tensor {name} has shape {tuple(t.shape)}, the model expects {tuple(expected[name].shape)}"
        for name, t in tensors.items()
        if name in expected and t.shape != expected[name].shape
    ]
    if problems:
        raise ValueError("; ".join(problems))
    return tensors
