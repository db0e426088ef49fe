"""Agents: `[async] def run(data, client) -> float | dict[str, float]` as a workflow.

    admitted row --> G sessions of the endpoint --> G concurrent run(row, client_g),
                     in the agent processes (rollout.agent_processes; started by agent_host.py,
                     each one agent_process.py)
        each call of run() --> OpenAIEndpoint --> engine.generate (recorded, token exact)
    rewards returned --> per-call rewards --> returns (rollout.turn_discount)
        --> samples (rollout.sample_mode: individual, or concat with a fallback)

`client` is an `openai.AsyncOpenAI` (an `openai.OpenAI` for a plain `def run`, which runs on
a thread) whose API key is the episode's session token: the agent imports nothing of ours.
An episode that raises, returns garbage or makes more than rollout.max_turns calls fails its
whole group (which the staleness gate counts once): the controller rejects it and generates
its row again; its calls still generating are aborted on the server. Counted per step:
episodes that fell back from concat (`rollout/concat_fallbacks`), their returns and calls
(`episode/return_mean`: undiscounted sum of the rewards, `episode/calls_mean`), the tool
calls the endpoint returned (`episode/tool_calls_mean`; `episode/tool_share`: episodes with
at least one), agent processes started again after dying (`episode/agent_restarts`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from areal.config import RolloutConfig
from areal.trajectory import Trajectory
from areal.workflow.agent_host import AgentHosts
from areal.workflow.agent_process import AgentRunner
from areal.workflow.api import EpisodeError, RolloutEngine, Workflow
from areal.workflow.openai_endpoint import OpenAIEndpoint, Session
from areal.workflow.samples import (
    Call,
    call_rewards,
    concat_sample,
    discounted_returns,
    individual_samples,
)
from areal.workflow.tool_parsers import load_tool_parser

log = logging.getLogger("areal.workflow")


AgentRun = Callable[[dict, Any], Awaitable[float | dict[str, float]] | float | dict[str, float]]
"""`[async] def run(data, client) -> reward(s)`: an agent, as the user writes it."""


def agent_spec(run: AgentRun) -> str:
    """The "module:function" by which an agent process imports `run`; ValueError if none."""
    from areal.plugins import resolve

    spec = f"{run.__module__}:{run.__qualname__}"
    try:
        importable = "<locals>" not in spec and resolve(spec, f"rollout.workflow={spec!r}") is run
    except ValueError:
        importable = False
    if not importable:
        raise ValueError(
            f"the agent {spec} cannot be imported by name, so no agent process can run it: "
            "define it at module level, or set rollout.agent_processes=0 to run it on the "
            "controller's loop"
        )
    return spec


class AgentWorkflow(Workflow):
    def __init__(self, run: AgentRun, rollout_cfg: RolloutConfig | None = None):
        self.run = run
        self.cfg = rollout_cfg or RolloutConfig()
        self.spec = agent_spec(run) if self.cfg.agent_processes else ""
        self.endpoint: OpenAIEndpoint | None = None
        self.hosts: AgentHosts | None = None
        """The agent processes (rollout.agent_processes > 0), started with the endpoint."""
        self._runner: AgentRunner | None = None
        """rollout.agent_processes=0: the agent on the controller's loop."""
        self._starting: asyncio.Task | None = None
        self._warned_fallback = False
        self._reset_counts()

    def _reset_counts(self) -> None:
        self._n_episodes = 0
        self._sum_return = 0.0
        self._sum_calls = 0
        self._sum_tool_calls = 0
        self._n_tool_episodes = 0
        self._fallbacks = 0

    async def _ready(self, engine: RolloutEngine) -> None:
        """The endpoint, and the agent processes or a base client: started by the first
        episode, in the running loop. Shielded: an episode that times out meanwhile does
        not cancel the start the others wait for; a failed start fails every episode."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start(engine))
        try:
            await asyncio.shield(self._starting)
        except RuntimeError as e:
            raise RuntimeError(str(e)) from None  # the same words, not one traceback grown

    async def _start(self, engine: RolloutEngine) -> None:
        try:
            import openai  # noqa: F401  (AgentRunner and the agent processes use it)
        except ImportError as e:
            raise RuntimeError(
                "an agent workflow hands its agent an openai client: pip install openai"
            ) from e
        model = Path(str(getattr(engine.tokenizer, "name_or_path", "") or "model")).name
        endpoint = OpenAIEndpoint(
            engine.tokenizer,
            model=model,
            default_max_tokens=self.cfg.max_new_tokens,
            sampling=engine.sampling_params,
            tool_parser=load_tool_parser(self.cfg.tool_parser),
        )
        await endpoint.start()
        self.endpoint = endpoint
        if self.cfg.agent_processes:
            self.hosts = AgentHosts(
                self.spec, self.cfg.agent_processes, endpoint.base_url, self.cfg.episode_timeout_s
            )
            await self.hosts.start()
            return
        for name in ("httpx", "httpx2"):  # one INFO line per call otherwise
            logging.getLogger(name).setLevel(logging.WARNING)
        self._runner = AgentRunner(self.run, endpoint.base_url, self.cfg.episode_timeout_s)

    async def arun_episode(self, engine: RolloutEngine, data: dict) -> list[Trajectory]:
        await self._ready(engine)
        assert self.endpoint is not None
        sessions = [
            self.endpoint.open_session(engine, self.cfg.max_turns) for _ in range(engine.group_size)
        ]
        tasks = [asyncio.ensure_future(self._episode(s, data)) for s in sessions]
        try:
            episodes = await asyncio.gather(*tasks)
        finally:  # one failed episode fails the group: stop the others, record nothing more
            for t in tasks:
                t.cancel()
            for s in sessions:
                self.endpoint.close_session(s)
        if not any(calls for calls, _ in episodes):
            raise EpisodeError("the agent made no call through the client it was given")
        samples: list[Trajectory] = []
        for calls, rewards in episodes:
            if not calls:
                continue
            returns = discounted_returns(rewards, self.cfg.turn_discount)
            samples += self._samples(calls, returns)
            self._n_episodes += 1
            self._sum_return += sum(rewards)
            self._sum_calls += len(calls)
            tool_calls = sum(c.tool_calls for c in calls)
            self._sum_tool_calls += tool_calls
            self._n_tool_episodes += tool_calls > 0
        return samples

    async def _episode(self, session: Session, data: dict) -> tuple[list[Call], list[float]]:
        """One run of the agent: its calls (in order) and each call's own reward."""
        try:
            if self.hosts is not None:
                result = await self.hosts.run(dict(data), session.token)
            else:
                result = await self._runner(dict(data), session.token)
        except Exception as e:
            if session.overrun:
                raise EpisodeError(session.overrun) from e
            raise
        if session.overrun:  # the agent caught the refusal: still an overrun episode
            raise EpisodeError(session.overrun)
        calls = list(session.calls)
        try:
            return calls, call_rewards(result, calls)
        except ValueError as e:
            raise EpisodeError(str(e)) from e

    def _samples(self, calls: list[Call], returns: list[float]) -> list[Trajectory]:
        if self.cfg.sample_mode == "concat":
            one = concat_sample(calls, returns)
            if one is not None:
                return [one]
            self._fallbacks += 1
            if not self._warned_fallback:
                self._warned_fallback = True
                log.warning(
                    "rollout.sample_mode=concat: a call's input does not start with the "
                    "previous call's input + output tokens (the chat template is not "
                    "append-only, or the agent changed the history); such episodes are "
                    "trained as individual calls (rollout/concat_fallbacks counts them)"
                )
        return individual_samples(calls, returns)

    def stats(self) -> dict[str, float]:
        n = max(self._n_episodes, 1)
        out = {
            "rollout/concat_fallbacks": float(self._fallbacks),
            "episode/return_mean": self._sum_return / n,
            "episode/calls_mean": self._sum_calls / n,
            "episode/tool_calls_mean": self._sum_tool_calls / n,
            "episode/tool_share": self._n_tool_episodes / n,
            "episode/count": float(self._n_episodes),
        }
        if self.hosts is not None:
            out["episode/agent_restarts"] = float(self.hosts.restarts)
            self.hosts.restarts = 0
        self._reset_counts()
        return out

    async def aclose(self) -> None:
        if self._starting is not None:
            self._starting.cancel()
        if self.hosts is not None:
            await self.hosts.close()
        if self._runner is not None:
            await self._runner.aclose()
        if self.endpoint is not None:
            await self.endpoint.close()
