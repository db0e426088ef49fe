"""Episodes: what one admitted row of the dataset turns into (see api.py).

    rollout.workflow = "package.module:object" names one of:
    - a subclass of `Workflow` (made without arguments) or an instance of one:
      `async arun_episode(engine, data) -> list[Trajectory] | None`, token in, token out,
      with optional `stats()` and `async aclose()` hooks (api.py);
    - an agent, `async def run(data, client) -> float | dict[str, float]` (or a plain `def`,
      run on a thread), run against an OpenAI-compatible endpoint that records the tokens
      of every call (agent.py).

single_turn.py is the default: today's math / code / arith path.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from areal import plugins
from areal.workflow.api import EpisodeError, EpisodeRunner, RolloutEngine, Workflow

if TYPE_CHECKING:
    from areal.config import RolloutConfig

__all__ = [
    "EpisodeError",
    "EpisodeRunner",
    "RolloutEngine",
    "Workflow",
    "as_workflow",
    "load_workflow",
]


def resolve(spec: str) -> Any:
    """The object "package.module:object" names; ValueError saying what to fix."""
    return plugins.resolve(spec, f"rollout.workflow={spec!r}")


def load_workflow(spec: str, rollout_cfg: RolloutConfig | None = None) -> Workflow:
    """The workflow rollout.workflow names (agents need rollout_cfg: turns, discount, mode)."""
    return as_workflow(resolve(spec), rollout_cfg, f"rollout.workflow={spec!r} names")


def is_workflow(obj: Any) -> bool:
    """`obj` is what as_workflow takes: a Workflow subclass or instance, or an agent."""
    return (
        (inspect.isclass(obj) and issubclass(obj, Workflow))
        or isinstance(obj, Workflow)
        or inspect.iscoroutinefunction(obj)
        or inspect.isfunction(obj)
    )


def as_workflow(
    obj: Any, rollout_cfg: RolloutConfig | None = None, what: str = "the episode is"
) -> Workflow:
    """A Workflow from a subclass (made without arguments), an instance, or an agent
    function (areal.build takes these objects; load_workflow the name of one)."""
    if inspect.isclass(obj) and issubclass(obj, Workflow):
        return obj()
    if isinstance(obj, Workflow):
        return obj
    if inspect.iscoroutinefunction(obj) or inspect.isfunction(obj):
        from areal.workflow.agent import AgentWorkflow

        return AgentWorkflow(obj, rollout_cfg)
    raise ValueError(
        f"{what} {obj!r:.80}, which is neither a workflow (a subclass "
        "of areal.workflow.Workflow with async arun_episode(engine, data), or an instance of "
        "one) nor an agent (async def run(data, client), or a plain def run(data, client))"
    )
