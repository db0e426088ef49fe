"""Versioned weights on shared storage: publish, find, retire.

    {exp_dir}/weights/v000007/   HF format (safetensors + config + tokenizer)

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


def weights_root(exp_dir: str | Path) -> Path:
    return Path(exp_dir) / "weights"


def version_dir(exp_dir: str | Path, version: int) -> Path:
    return weights_root(exp_dir) / f"v{version:06d}"


def publish(exp_dir: str | Path, version: int, write: Callable[[Path], None]) -> Path:
    """Call write(tmp_dir) and atomically rename tmp_dir to the version's directory."""
    final = version_dir(exp_dir, version)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if final.exists():  # a resumed run republishing a version it had already written
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def published_versions(exp_dir: str | Path) -> list[int]:
    root = weights_root(exp_dir)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _NAME.match(p.name)))


def retire_older_than(exp_dir: str | Path, version: int) -> list[int]:
    """Delete published versions older than `version` (acknowledged by every server)."""
    retired = [v for v in published_versions(exp_dir) if v < version]
    for v in retired:
        shutil.rmtree(version_dir(exp_dir, v), ignore_errors=True)
    return retired
