"""Trainer backends: one module each, found by name like an inference backend.

    trainer.backend = "torch" | "megatron"   (areal/trainer/backends/<name>.py: BACKEND)
        load_backend(name) --> TrainerBackendSpec
            .check(cfg)         its config rules (ConfigError), when the config loads
            .build(cfg, model_dir, dp, optimizer) -> (TrainerBackend, dp over its replicas)
                                its model (areal/worker.py's make_backend, every rank)
            .in_process         it trains in the launcher's process (launcher.type=inline)

A new backend is one module here defining `BACKEND` (a TrainerBackendSpec) whose build imports
its implementation lazily; nothing else names it. This package imports none of them
(load_backend does, by name), nor torch, nor areal.config: the config validates
trainer.backend through this registry, and the torch path never imports megatron.
"""

from __future__ import annotations

import abc
import functools
import importlib
import pkgutil
from typing import Any

from areal.config_loader import ConfigError

DEFAULT = "torch"
"""trainer.backend's default, first among the names: the data-parallel trainer of the paper."""


class TrainerBackendSpec(abc.ABC):
    """What areal needs to name a trainer backend in the config: its rules and its builder.
    `cfg` is the run's ExperimentConfig; the built backend is a trainer.backend.TrainerBackend
    (trainer/step.py and trainer/worker.py drive it)."""

    name: str = ""
    in_process: bool = False
    """It trains on one rank without a process group, beside every other role
    (launcher.type=inline: areal/inline.py)."""

    def check(self, cfg: Any) -> None:
        """Raise ConfigError for a config this backend cannot train (called on load)."""
        return None  # a backend without rules of its own accepts every config

    @abc.abstractmethod
    def build(self, cfg: Any, model_dir: Any, dp: Any, optimizer: Any) -> tuple[Any, Any]:
        """(the TrainerBackend over the HF weights in model_dir, trained by `optimizer`, an
        optimizer.OptimizerSpec; the parallel.DataParallel `dp` narrowed to the group its
        gradients are summed over)."""


@functools.cache
def names() -> tuple[str, ...]:
    """The backends' names (the modules of this package), the default first."""
    found = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    return tuple(sorted(found, key=lambda name: (name != DEFAULT, name)))


@functools.cache
def load_backend(name: str) -> TrainerBackendSpec:
    """The backend `name`; ConfigError naming the known ones."""
    if name not in names():
        raise ConfigError(f"unknown trainer backend {name!r}: use one of {', '.join(names())}")
    backend = importlib.import_module(f"{__name__}.{name}").BACKEND
    assert isinstance(backend, TrainerBackendSpec) and backend.name == name, name
    return backend
