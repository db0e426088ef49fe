"""An experiment directory is never overwritten without the user's word.

    python -m areal.train ... --> claim(exp_dir, the config as a dict, resume, overwrite)
        {exp_dir} holds no run             -> start afresh
        resume=true                        -> resume it (train.py)
        overwrite=true                     -> move it aside to {exp_dir}.old-<time>, start afresh
        its config.yaml equals this config -> resume it, and say so
        otherwise                          -> ConfigError naming the directory, what differs
                                              and the three ways on; nothing is touched

A run is "held" once its config.yaml, metrics or checkpoints exist. Nothing here deletes:
the only change it makes is one rename, asked for by overwrite=true.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from areal.config import ConfigError

IGNORED = ("resume", "overwrite")
"""Keys that say how to start, not what the run is."""


def holds_run(exp: Path) -> bool:
    """The directory holds (part of) a run: its config, metrics or checkpoints."""
    return any((exp / name).exists() for name in ("config.yaml", "metrics.jsonl", "checkpoints"))


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "options":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(saved: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every key whose value differs (the starting keys aside)."""
    # Through YAML, as config.yaml was written: tuples become lists, floats print alike.
    new = _flat(yaml.safe_load(yaml.safe_dump(config, sort_keys=False)))
    old = _flat(saved)
    saved_model = str(old.get("model.path", ""))
    if not new.get("model.path") and Path(saved_model).name.startswith("tiny-"):
        # The saved config names the tiny model it resolved; the tiny_* keys are compared.
        new["model.path"] = saved_model
    return [
        f"{k}: {old.get(k, '(absent)')!r} -> {new.get(k, '(absent)')!r}"
        for k in sorted(old.keys() | new.keys())
        if k not in IGNORED and old.get(k) != new.get(k)
    ]


def aside_name(exp: Path) -> Path:
    """Where overwrite=true moves the run: {exp}.old-YYYYmmdd-HHMMSS (a suffix if taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = exp.with_name(f"{exp.name}.old-{stamp}")
    n = 1
    while target.exists():
        target = exp.with_name(f"{exp.name}.old-{stamp}-{n}")
        n += 1
    return target


def claim(exp: Path, config: dict[str, Any], *, resume: bool, overwrite: bool) -> bool:
    """Decide how to start in `exp` for the run of `config` (the config as a dict; see the
    module's table); whether to resume. The caller sets overwrite=false: done once, a
    recovery resumes."""
    if resume or not holds_run(exp):
        return resume
    if overwrite:
        target = aside_name(exp)
        exp.rename(target)
        print(f"areal: overwrite=true: moved the run that was in {exp} to {target}")
        return False
    try:
        saved = yaml.safe_load((exp / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        saved = None
    diff = differences(saved, config) if isinstance(saved, dict) else ["(no readable config.yaml)"]
    if not diff:
        print(
            f"areal: {exp} holds a run with this same config: resuming it "
            "(a new trial_name=NAME starts another run beside it)"
        )
        return True
    shown = "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
    raise ConfigError(
        f"{exp} holds another run (its config differs: {shown}). Nothing was changed. To go "
        "on, either: give a new trial_name=NAME (a new directory beside it); or resume=true "
        "(continue that run from its latest checkpoint with this config); or overwrite=true "
        f"(move that run aside to {exp.name}.old-<time> and start afresh; nothing is deleted)"
    )
