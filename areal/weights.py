"""Versioned weights on shared storage: publish, find, retire.

    {exp_dir}/weights/v000007/   HF format (safetensors + config + tokenizer), or with
                                 model.lora the adapter alone (adapter_config.json +
                                 adapter_model.safetensors, PEFT's format; areal/lora.py)

The trainer writes `v000007.tmp/` and renames it, so a reader never sees a half-written
version. Version 0 is the initial model directory itself. A version is retired only after
every inference server has acknowledged a newer one (never the newest).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

_NAME = re.compile(r"^v(\d{6})$")
# What a published version carries besides config.json and the weights: the tokenizer (so
# SGLang and transformers load the directory alone) and the generation defaults.
_COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def copy_companion_files(source: Path, out: Path) -> None:
    """Copy the tokenizer and generation files of model directory source into out."""
    for name in _COMPANION_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, out / name)


ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_dir(path: str | Path) -> bool:
    """Whether a version (or checkpoint model/) directory holds a LoRA adapter, not a model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def write_tensors(out: Path, tensors: dict, model_dir: Path) -> None:
    """A version directory from tensors in memory: model.safetensors, and the config,
    tokenizer and generation files of the model directory they came from."""
    from safetensors.torch import save_file  # imports torch: only the writers need it

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy2(model_dir / "config.json", out / "config.json")
    copy_companion_files(model_dir, out)


def version_name(version: int) -> str:
    """The directory name of a version, here and in checkpoints/: v000007."""
    return f"v{version:06d}"


def versions_in(root: Path) -> list[int]:
    """Versions with a complete directory under root (half-written `.tmp` ones excluded)."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _NAME.match(p.name)))


def write_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp_dir), then rename tmp_dir to final: readers see all of it or nothing."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if final.exists():  # a resumed run writing a version again
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def weights_root(exp_dir: str | Path) -> Path:
    return Path(exp_dir) / "weights"


def version_dir(exp_dir: str | Path, version: int) -> Path:
    return weights_root(exp_dir) / version_name(version)


def publish(exp_dir: str | Path, version: int, write: Callable[[Path], None]) -> Path:
    """Call write(tmp_dir) and atomically rename tmp_dir to the version's directory."""
    return write_atomically(version_dir(exp_dir, version), write)


def published_versions(exp_dir: str | Path) -> list[int]:
    return versions_in(weights_root(exp_dir))


def retire_older_than(exp_dir: str | Path, version: int) -> list[int]:
    """Delete published versions older than `version` (acknowledged by every server)."""
    retired = [v for v in published_versions(exp_dir) if v < version]
    for v in retired:
        shutil.rmtree(version_dir(exp_dir, v), ignore_errors=True)
    return retired
