"""The reward service: grades responses in a process pool, off the controller's loop.

    controller --grade(task, responses, answer)--> service --> pool worker per response
               <-- rewards (+correct / wrong) ----          <-- verdict | error | timeout

Grading runs in separate processes so that a slow or crashing grader never blocks the
service and so that graders needing the main thread (signals) have one. A grader error or
a timeout scores the response as wrong and is counted; it never fails the request. The pool
is pebble's: it kills a grading process that outlives its timeout (and only that one) and
starts another in its place, and reports a process that died as ProcessExpired.
Graders: arith (areal.data.arith), math (areal.reward.math, math-verify), code
(areal.reward.code: unit tests in areal.reward.sandbox).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import TimeoutError as FutureTimeout

from pebble import ProcessExpired, ProcessPool

from areal.data import arith, longtail
from areal.process import die_with_parent
from areal.reward import code, math, sandbox

log = logging.getLogger("areal.reward")

# task -> is_correct(response, answer). The answer is whatever the dataset row holds
# (msgpack-able): a string for arith, longtail and math, the unit tests for code.
GRADERS = {
    "arith": arith.is_correct,
    "longtail": longtail.is_correct,
    "math": math.is_correct,
    "code": code.is_correct,
}


def grade_one(task: str, response: str, answer, options: dict) -> bool:
    """Runs in a pool process; `options` are the grader's keyword arguments."""
    return bool(GRADERS[task](response, answer, **options))


class RewardService:
    def __init__(
        self,
        *,
        n_workers: int,
        timeout_s: float,
        correct: float,
        wrong: float,
        code_time_limit_s: float = 6.0,
        code_memory_mb: int = 1024,
    ):
        self.n_workers = n_workers
        self.timeout_s = timeout_s
        self.correct = correct
        self.wrong = wrong
        self.options = {
            "code": {"time_limit_s": code_time_limit_s, "memory_mb": code_memory_mb},
        }
        # Probed once here, before the pool forks, so its processes inherit the answer.
        try:
            mode = sandbox.mode()
        except RuntimeError as e:  # no interpreter the sandbox may run: code answers error
            mode = f"unusable ({e})"
        if mode == "bwrap":
            log.info("code sandbox: bwrap (namespaces, private file system)")
        else:
            log.warning(
                "code sandbox: %s; install bubblewrap for network and file-system "
                "isolation (see README, Sandbox)",
                mode,
            )
        self.pool = ProcessPool(n_workers, initializer=die_with_parent)
        # At most one grading per pool process is submitted, so that a response's time
        # limit counts its own grading, never its wait in the pool's queue.
        self.slots = asyncio.Semaphore(n_workers)
        self.counts = {"graded": 0, "timeouts": 0, "errors": 0}

    async def grade(self, task: str, responses: list[str], answer) -> list[float]:
        if task not in GRADERS:
            raise ValueError(f"no grader for task {task!r}; known: {sorted(GRADERS)}")
        verdicts = await asyncio.gather(*(self._grade(task, r, answer) for r in responses))
        return [self.correct if ok else self.wrong for ok in verdicts]

    async def _grade(self, task: str, response: str, answer) -> bool:
        async with self.slots:
            return await self._grade_now(task, response, answer)

    async def _grade_now(self, task: str, response: str, answer) -> bool:
        self.counts["graded"] += 1
        future = self.pool.schedule(
            grade_one, (task, response, answer, self.options.get(task, {})), timeout=self.timeout_s
        )
        try:
            return await asyncio.wrap_future(future)
        except (FutureTimeout, TimeoutError):  # pebble killed that grading's process
            self.counts["timeouts"] += 1
            log.warning("grading timed out after %.1fs; scored wrong", self.timeout_s)
        except ProcessExpired as e:  # the grading process died (a grader crash, OOM kill)
            self.counts["errors"] += 1
            log.warning("a grading process died (%s); scored wrong", e)
        except Exception as e:  # a grader bug must not take the service down
            self.counts["errors"] += 1
            log.warning("grader error (%s: %s); scored wrong", type(e).__name__, e)
        return False

    async def stats(self) -> dict:
        counts, self.counts = self.counts, {"graded": 0, "timeouts": 0, "errors": 0}
        return counts

    def close(self) -> None:
        # stop() kills the processes, so a stuck grading cannot hold up the shutdown.
        self.pool.stop()
        self.pool.join(timeout=30)
