"""Plugins named in a config as "package.module:object" (a task, a workflow, an agent)."""

from __future__ import annotations

import importlib
import re
from typing import Any

SPEC = re.compile(r"[\w.]+:[\w.]+")
""""package.module:object"."""


def resolve(spec: str, what: str, error: type[ValueError] = ValueError) -> Any:
    """The object "package.module:object" names; `error` starting with `what` (the config key
    or the kind of plugin) saying what to fix."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise error(
            f"{what}: cannot import {module_name!r} ({e}); is it on PYTHONPATH (the run's "
            "working directory is)?"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{what}: {module_name} has no {attr!r}")
        obj = getattr(obj, part)
    return obj
