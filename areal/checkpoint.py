"""Checkpoints: trainer and controller state saved together, so a run resumes where it
stopped without training on any sample twice.

    {exp_dir}/checkpoints/v000020/
        model/                 HF directory (the policy after 20 updates)
        optimizer.safetensors  optimizer and scheduler tensors
        trainer.json           everything else of the trainer's state
        controller.msgpack     dataset position, prompts to generate again, ready groups

Written as `v000020.tmp/` and renamed once both roles have written their part, so a crash
mid-save leaves the previous checkpoint as the latest. Nothing is pickled: the directory
is shared storage, and a checkpoint must be safe to load from anyone's experiment.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_NAME = re.compile(r"^v(\d{6})$")


@dataclass(frozen=True)
class Checkpoint:
    version: int
    path: Path

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def controller_state(self) -> Path:
        return self.path / "controller.msgpack"


def checkpoint_dir(exp_dir: str | Path, version: int) -> Path:
    return Path(exp_dir) / "checkpoints" / f"v{version:06d}"


def latest(exp_dir: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint, if any."""
    root = Path(exp_dir) / "checkpoints"
    found = [int(m.group(1)) for p in root.glob("v*") if (m := _NAME.match(p.name))]
    if not found:
        return None
    v = max(found)
    return Checkpoint(v, checkpoint_dir(exp_dir, v))


def commit(tmp: Path, version: int, exp_dir: str | Path) -> Checkpoint:
    """Make a fully written tmp directory the latest checkpoint and drop older ones."""
    final = checkpoint_dir(exp_dir, version)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for p in final.parent.iterdir():
        if p != final:
            shutil.rmtree(p, ignore_errors=True)
    return Checkpoint(version, final)


# ---- tensors apart from structure: safetensors + JSON instead of pickle ----------------------
def _split(obj, tensors: dict[str, torch.Tensor], prefix: str):
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        # JSON keys are strings: remember the int keys of optimizer state.
        return {"__dict__": [[k, _split(v, tensors, f"{prefix}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [_split(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
    return obj


def _join(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, dict) and "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if isinstance(obj, dict) and "__dict__" in obj:
        return {k: _join(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    return obj


def save_state(state: dict, json_path: Path, tensors_path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    tree = _split(state, tensors, "s")
    save_file(tensors, str(tensors_path))
    json_path.write_text(json.dumps(tree))


def load_state(json_path: Path, tensors_path: Path) -> dict:
    return _join(json.loads(json_path.read_text()), load_file(str(tensors_path)))
