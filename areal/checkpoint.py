"""Checkpoints: trainer and controller state saved together, so a run resumes where it
stopped without training on any sample twice.

    {exp_dir}/checkpoints/v000020/
        model/                 HF directory (the policy after 20 updates)
        trainer.json           the backend's state_dict (optimizer steps; megatron: tp, pp)
        optimizer.safetensors  the tensors of trainer.json, if any
        optimizer-tp0-pp0.*    the optimizer state of each model-parallel position (torch: one)
        controller.msgpack     dataset position, prompts to generate again, ready groups

Written as `v000020.tmp/` and renamed once both roles (and every model-parallel trainer
rank) have written their part, so a crash mid-save leaves the previous checkpoint as the
latest. Nothing is pickled: the directory
is shared storage, and a checkpoint must be safe to load from anyone's experiment.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from areal.weights import version_name, versions_in, write_atomically

CONTROLLER_STATE = "controller.msgpack"
_TRAINER_STATE = "trainer.json"
_OPTIMIZER_TENSORS = "optimizer.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    version: int
    path: Path

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def controller_state(self) -> Path:
        return self.path / CONTROLLER_STATE


def checkpoints_root(exp_dir: str | Path) -> Path:
    return Path(exp_dir) / "checkpoints"


def latest(exp_dir: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint, if any."""
    found = versions_in(checkpoints_root(exp_dir))
    if not found:
        return None
    return Checkpoint(found[-1], checkpoints_root(exp_dir) / version_name(found[-1]))


def save(exp_dir: str | Path, version: int, write: Callable[[Path], None]) -> Checkpoint:
    """Call write(tmp_dir) for every role's part, commit it as the latest, drop older ones."""
    final = write_atomically(checkpoints_root(exp_dir) / version_name(version), write)
    for p in final.parent.iterdir():
        if p != final:
            shutil.rmtree(p, ignore_errors=True)
    return Checkpoint(version, final)


def _save(directory: Path, tensors_name: str, tree_name: str, state: dict) -> None:
    from areal.tensor_tree import save_tree  # torch: not in the launcher

    save_tree(directory, tensors_name, tree_name, state)


def _load(directory: Path, tensors_name: str, tree_name: str) -> dict:
    from areal.tensor_tree import load_tree

    return load_tree(directory, tensors_name, tree_name)


def save_trainer_state(directory: Path, state: dict) -> None:
    _save(directory, _OPTIMIZER_TENSORS, _TRAINER_STATE, state)


def load_trainer_state(directory: Path) -> dict:
    return _load(directory, _OPTIMIZER_TENSORS, _TRAINER_STATE)


def save_rank_state(directory: Path, name: str, state: dict) -> None:
    """One trainer rank's own part (e.g. name="optimizer-tp1-pp0"): name.safetensors/.json."""
    _save(directory, f"{name}.safetensors", f"{name}.json", state)


def load_rank_state(directory: Path, name: str) -> dict:
    if not (directory / f"{name}.json").exists():
        raise ValueError(f"{directory} has no {name}.json: the checkpoint lacks this rank's part")
    return _load(directory, f"{name}.safetensors", f"{name}.json")
