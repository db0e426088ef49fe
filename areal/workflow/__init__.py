"""Episodes: what one admitted row of the dataset turns into (see api.py).

    rollout.workflow = "package.module:object" names one of:
    - an object (or a class, made without arguments) with
      `async arun_episode(engine, data) -> list[Trajectory] | None`, or a module-level
      `async def arun_episode(engine, data)`: token in, token out (api.py);
    - anything else callable, or an object with `run`: an agent,
      `async run(data, client) -> float | dict[str, float]`, run against an
      OpenAI-compatible endpoint that records the tokens of every call (agent.py).

single_turn.py is the default: today's math / code / arith path.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from areal.workflow.api import EpisodeError, EpisodeRunner, RolloutEngine, Workflow

__all__ = ["EpisodeError", "EpisodeRunner", "RolloutEngine", "Workflow", "load_workflow"]


def resolve(spec: str) -> Any:
    """The object "package.module:object" names; ValueError saying what to fix."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"rollout.workflow={spec!r}: cannot import {module_name!r} ({e}); is it on "
            "PYTHONPATH (the run's working directory is)?"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"rollout.workflow={spec!r}: {module_name} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_workflow(spec: str, rollout_cfg=None) -> Workflow:
    """The workflow rollout.workflow names (agents need rollout_cfg: turns, discount, mode)."""
    obj = resolve(spec)
    if inspect.isclass(obj) and hasattr(obj, "arun_episode"):
        return obj()
    if hasattr(obj, "arun_episode"):
        return obj
    if inspect.iscoroutinefunction(obj) and obj.__name__ == "arun_episode":
        return _FunctionWorkflow(obj)
    run = obj.run if hasattr(obj, "run") and not inspect.isfunction(obj) else obj
    if not callable(run):
        raise ValueError(
            f"rollout.workflow={spec!r} is neither a workflow (arun_episode(engine, data)) "
            "nor an agent (async run(data, client))"
        )
    from areal.workflow.agent import AgentWorkflow

    return AgentWorkflow(run, rollout_cfg)


class _FunctionWorkflow:
    def __init__(self, fn):
        self.fn = fn

    async def arun_episode(self, engine, data):
        return await self.fn(engine, data)
