"""The reward service: grades responses in a process pool, off the controller's loop.

    controller --grade(task, responses, answer)--> service --> pool worker per response
               <-- rewards (+correct / wrong) ----          <-- verdict | error | timeout

Grading runs in separate processes so that a slow or crashing grader never blocks the
service and so that graders needing the main thread (signals) have one. A grader error or
a timeout scores the response as wrong and is counted; it never fails the request.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from areal.data import arith
from areal.process import die_with_parent

log = logging.getLogger("areal.reward")

GRADERS = {"arith": arith.is_correct}


def grade_one(task: str, response: str, answer: str) -> bool:
    """Runs in a pool process."""
    return bool(GRADERS[task](response, answer))


class RewardService:
    def __init__(self, *, n_workers: int, timeout_s: float, correct: float, wrong: float):
        self.n_workers = n_workers
        self.timeout_s = timeout_s
        self.correct = correct
        self.wrong = wrong
        self.pool = self._new_pool()
        self.counts = {"graded": 0, "timeouts": 0, "errors": 0}

    async def grade(self, task: str, responses: list[str], answer: str) -> list[float]:
        if task not in GRADERS:
            raise ValueError(f"no grader for task {task!r}; known: {sorted(GRADERS)}")
        verdicts = await asyncio.gather(*(self._grade(task, r, answer) for r in responses))
        return [self.correct if ok else self.wrong for ok in verdicts]

    async def _grade(self, task: str, response: str, answer: str) -> bool:
        self.counts["graded"] += 1
        try:
            fut = self.pool.submit(grade_one, task, response, answer)
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
        except TimeoutError:
            self.counts["timeouts"] += 1
            log.warning("grading timed out after %.1fs; scored wrong", self.timeout_s)
            self._restart_pool()  # the stuck process would otherwise hold a worker forever
        except BrokenProcessPool:
            self.counts["errors"] += 1
            log.warning("a grading process died; restarting the pool; scored wrong")
            self._restart_pool()
        except Exception as e:  # a grader bug must not take the service down
            self.counts["errors"] += 1
            log.warning("grader error (%s: %s); scored wrong", type(e).__name__, e)
        return False

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.n_workers, initializer=die_with_parent)

    def _restart_pool(self) -> None:
        old, self.pool = self.pool, self._new_pool()
        for proc in list(getattr(old, "_processes", {}).values()):
            proc.kill()
        old.shutdown(wait=False, cancel_futures=True)

    async def stats(self) -> dict:
        counts, self.counts = self.counts, {"graded": 0, "timeouts": 0, "errors": 0}
        return counts

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
