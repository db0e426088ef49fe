"""The workflow API: what one admitted row of the dataset turns into, token in, token out.

    Controller.admit() --row--> EpisodeRunner.run(engine, row)
        workflow.arun_episode(engine, row) --> list[Trajectory] (its group) | None (declined)
            | engine.generate(ids, n) --> WorkerPool --> rollout worker k
            | engine.grade(...)       --> reward service
        an exception or a timeout --> EpisodeError (rejected; the row is drawn again)

A workflow subclasses `Workflow`: `async arun_episode(engine, data)` is the episode, and
`stats()` (metrics since the previous step) and `async aclose()` (the run ends) are hooks
that default to nothing. `engine.generate` goes through the same interruptible,
failover-safe path as the default single-turn episode: each returned token carries its
behaviour log-prob and version.

Outcomes, as the controller treats them (the gate counts one admitted row as one group):
- trajectories: checked here (lengths line up, rewards finite), then buffered;
- None: the workflow declined the row (a filter): its place in the gate is freed and the
  row is used up, counted in `rollout/episodes_declined`;
- an exception, or running past `rollout.episode_timeout_s`: the group is rejected, its
  place in the gate freed and the row drawn again later; counted in
  `rollout/episodes_rejected` / `rollout/episodes_timeout`, the traceback logged once.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from areal.trajectory import Trajectory, TrajectoryRef

log = logging.getLogger("areal.workflow")

GenerateFn = Callable[[list[int], int, dict], Awaitable[list[Trajectory]]]
GradeFn = Callable[[str, list[str], Any], Awaitable[list[float]]]
GenerateGradedFn = Callable[[list[int], int, dict, dict], Awaitable[list[TrajectoryRef]]]


class EpisodeError(Exception):
    """An episode failed: it is rejected and its row generated again."""


class EpisodeTimeout(EpisodeError):
    """An episode ran past rollout.episode_timeout_s."""


@dataclass(kw_only=True)
class RolloutEngine:
    """What an episode may use: generation through the run's servers, and its grader.

    One engine per admitted row: every trajectory it returns belongs to the group
    `group_id` (the samples of that row's prompt), admitted under `start_version`.
    """

    tokenizer: Any
    group_size: int
    """G: samples (single-turn) or episodes (agents) per row."""
    sampling_params: dict
    """The run's sampling parameters (rollout.*): the trainer's log-probs assume them."""
    group_id: int
    start_version: int
    generate_fn: GenerateFn
    grade_fn: GradeFn | None = None
    generate_graded_fn: GenerateGradedFn | None = None
    """The pull data plane: generation and grading on the rollout worker, which keeps the
    tokens (areal/data_plane.py); None: generate_graded decodes and grades here."""

    async def generate(
        self, input_ids: list[int], n: int = 1, max_new_tokens: int | None = None
    ) -> list[Trajectory]:
        """n samples continuing `input_ids` (the exact tokens the server sees), finished.

        Temperature, top-p and top-k are the run's: the trainer computes log-probs under
        them, so an episode may choose only the length.
        """
        params = dict(self.sampling_params)
        if max_new_tokens is not None:
            params["max_new_tokens"] = int(max_new_tokens)
        return await self.generate_fn(list(input_ids), n, params)

    async def generate_graded(
        self, input_ids: list[int], n: int, task: str, answer: Any
    ) -> list[Trajectory | TrajectoryRef]:
        """n samples continuing `input_ids`, each rewarded by the reward service's grade of
        its decoded text (special tokens skipped): graded on text, trained on the recorded
        tokens. With the pull data plane the rollout worker that generated them decodes,
        grades and keeps them, and they come back as TrajectoryRefs (rewards set)."""
        if self.generate_graded_fn is not None:
            grade = {"task": task, "answer": answer}
            return await self.generate_graded_fn(list(input_ids), n, self.sampling_params, grade)
        trajs = await self.generate(input_ids, n)
        texts = [self.tokenizer.decode(t.output_ids, skip_special_tokens=True) for t in trajs]
        rewards = await self.grade(task, texts, answer)
        for t, r in zip(trajs, rewards, strict=True):
            t.reward = r
        return trajs

    async def grade(self, task: str, responses: list[str], answer: Any) -> list[float]:
        """Rewards of responses from the reward service (math, code, arith graders)."""
        if self.grade_fn is None:
            raise RuntimeError("this engine has no reward service")
        return await self.grade_fn(task, responses, answer)


@runtime_checkable
class Workflow(Protocol):
    """The episode seam. Subclass it: `arun_episode` is yours to write, the hooks default
    to nothing (a class that only looks like one is refused by `load_workflow`)."""

    @abc.abstractmethod
    async def arun_episode(
        self, engine: RolloutEngine, data: dict
    ) -> list[Trajectory | TrajectoryRef] | None:
        """The trajectories of one admitted row (its group), or None to decline the row."""

    def stats(self) -> dict[str, float]:
        """Metrics since the previous call, merged into the step's (`get_batch`)."""
        return {}

    async def aclose(self) -> None:
        """Release what the episodes set up (an endpoint, clients): the run ends."""
        return None


def check_trajectories(trajs: Any) -> list[Trajectory | TrajectoryRef]:
    """The workflow's result, or EpisodeError saying what is wrong with it."""
    if not isinstance(trajs, list) or not trajs:
        raise EpisodeError(
            f"arun_episode must return a non-empty list of Trajectory or None, got {trajs!r:.200}"
        )
    for i, t in enumerate(trajs):
        if isinstance(t, TrajectoryRef):  # made by a rollout worker, which checked its tokens
            if not t.n_prompt or not t.n_output:
                raise EpisodeError(f"trajectory {i} has an empty prompt or output")
            if not isinstance(t.reward, int | float) or not math.isfinite(t.reward):
                raise EpisodeError(f"trajectory {i} has reward {t.reward!r}; must be finite")
            continue
        if not isinstance(t, Trajectory):
            raise EpisodeError(f"trajectory {i} is a {type(t).__name__}, not a Trajectory")
        n = len(t.output_ids)
        problem = None
        if not t.prompt_ids or not n:
            problem = "has an empty prompt or output"
        elif len(t.logprobs) != n or len(t.versions) != n:
            problem = (
                f"has {n} output tokens but {len(t.logprobs)} log-probs, {len(t.versions)} versions"  # noqa: E501
            )
        elif t.loss_mask and (len(t.loss_mask) != n or not any(t.loss_mask)):
            problem = "has a loss_mask that is not one 0/1 per output token with some 1"
        elif not isinstance(t.reward, int | float) or not math.isfinite(t.reward):
            problem = f"has reward {t.reward!r}; rewards must be finite numbers"
        if problem:
            raise EpisodeError(f"trajectory {i} {problem}")
    return trajs


class EpisodeRunner:
    """Runs one group's episode under the time limit, checks its result, counts and logs
    failures."""

    def __init__(self, workflow: Workflow, timeout_s: float):
        self.workflow = workflow
        self.timeout_s = timeout_s
        self.counts = {"rejected": 0, "timeout": 0, "declined": 0}
        self._logged: set[str] = set()

    async def run(
        self, engine: RolloutEngine, data: dict
    ) -> list[Trajectory | TrajectoryRef] | None:
        """Trajectories, None (declined) or EpisodeError (rejected; its row is drawn again)."""
        deadline = time.monotonic() + self.timeout_s
        try:
            result = await asyncio.wait_for(
                self.workflow.arun_episode(engine, data), self.timeout_s
            )
            if result is None:
                self.counts["declined"] += 1
                return None
            return check_trajectories(result)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError as e:
            if time.monotonic() < deadline:  # the episode's own timeout, not ours
                self.counts["rejected"] += 1
                self._log_once(e)
                raise EpisodeError(f"{type(e).__name__}: {e}") from e
            self.counts["timeout"] += 1
            log.warning("episode ran past rollout.episode_timeout_s=%g; its prompt will be "
                        "generated again", self.timeout_s)  # fmt: skip
            raise EpisodeTimeout(
                f"the episode ran past rollout.episode_timeout_s={self.timeout_s:g}"
            ) from e
        except Exception as e:
            self.counts["rejected"] += 1
            self._log_once(e)
            if isinstance(e, EpisodeError):
                raise
            raise EpisodeError(f"{type(e).__name__}: {e}") from e

    def _log_once(self, e: Exception) -> None:
        """The whole traceback the first time a failure is seen here, one line after."""
        tb = traceback.format_exception(e)
        where = "".join(tb[-3:])  # the raising frame and the message
        if where in self._logged:
            log.warning("episode rejected again: %s: %s", type(e).__name__, e)
            return
        self._logged.add(where)
        log.warning("episode rejected (its prompt will be generated again):\n%s", "".join(tb))

    def stats(self) -> dict[str, float]:
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return {f"rollout/episodes_{k}": float(v) for k, v in counts.items()}
