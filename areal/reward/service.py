"""The reward service: grades responses in a process pool, off the controller's loop.

    controller --grade(task, responses, answer)--> service --> pool worker per response
               <-- rewards (+correct / wrong) ----          <-- verdict | error | timeout

`task` is the row's dataset.type (a short name or "package.module:object", areal/tasks/):
each pool process loads that task once and calls its grader with the options the task takes
from the reward section (the code sandbox's limits). Grading runs in separate processes so
that a slow or crashing grader never blocks the service and so that graders needing the main
thread (signals) have one. A grader error or a timeout scores the response as wrong and is
counted; it never fails the request. The pool is pebble's: it kills a grading process that
outlives its timeout (and only that one) and starts another in its place, and reports a
process that died as ProcessExpired. A task whose grader is a regex (Task.grade_inline) is
graded in the service's own process: the pool's round trip would cost more.

A task with a screen (math) is looked at here first: a certain verdict (no final answer, the
gold answer's own string, two integers) costs no pool round trip and no sympy; otherwise the
screen names the question (boxed answer, gold), which the pool answers once: the verdict is
kept (the most recent MAX_VERDICTS) and shared with every response that asks the same, those
asked while it is being graded included. A question whose grading failed is asked again.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pebble import ProcessExpired, ProcessPool

from areal.config import RewardConfig
from areal.cores import Grading
from areal.process import die_with_parent
from areal.tasks import Task, load_task
from areal.tasks.graders import sandbox

log = logging.getLogger("areal.reward")

MAX_VERDICTS = 65_536
"""Questions whose verdicts the service keeps (a few hundred bytes each)."""
COUNTS = ("graded", "screened", "reused", "timeouts", "errors")


def grade_one(task: str, response: str, answer: Any, options: dict) -> bool:
    """Runs in a pool process (which loads the task once); `options` are the grader's
    keyword arguments. The answer is whatever the row holds (msgpack-able)."""
    return bool(load_task(task).is_correct(response, answer, **options))


def grade_with(is_correct: Callable[..., bool], response: str, answer: Any, options: dict) -> bool:
    """grade_one for a task handed in as an object (areal.build): the grader travels to the
    pool process pickled (by reference: a module-level function), as no name loads it."""
    return bool(is_correct(response, answer, **options))


class RewardService:
    def __init__(self, cfg: RewardConfig, tasks: dict[str, Task] | None = None):
        """`tasks`: tasks given as objects (areal.build), by the name the rows carry; they
        take precedence over the tasks load_task finds by that name."""
        self.tasks = dict(tasks or {})
        self.timeout_s = cfg.timeout_s
        self.correct = cfg.correct
        self.wrong = cfg.wrong
        self.cfg = cfg
        self.options: dict[str, dict] = {}  # task -> its grader's options, made on first use
        # Probed once here, before the pool forks, so its processes inherit the answer.
        try:
            self.sandbox_mode = sandbox.mode()
        except RuntimeError as e:  # no interpreter the sandbox may run: code answers error
            self.sandbox_mode = f"unusable ({e})"
        self.pool = ProcessPool(cfg.n_workers, initializer=die_with_parent)
        # At most one grading per pool process is submitted, so that a response's time
        # limit counts its own grading, never its wait in the pool's queue.
        self.slots = asyncio.Semaphore(cfg.n_workers)
        self.grading = Grading()  # the cores the pool uses, in the node's ledger (cores.py)
        self.verdicts: OrderedDict[tuple, asyncio.Future[bool]] = OrderedDict()
        self.counts = dict.fromkeys(COUNTS, 0)

    async def grade(self, task: str, responses: list[str], answer: Any) -> list[float]:
        if task not in self.options:  # an unknown task fails the request (ConfigError)
            grader = self._task(task)
            for module in grader.grader_imports:  # before the pool forks (on its first use)
                importlib.import_module(module)
            self.options[task] = grader.grader_options(self.cfg)
            if grader.uses_sandbox:  # said only where code runs (arith, math: never)
                self._say_sandbox()
        verdicts = await asyncio.gather(*(self._grade(task, r, answer) for r in responses))
        return [self.correct if ok else self.wrong for ok in verdicts]

    def _say_sandbox(self) -> None:
        if self.sandbox_mode == "bwrap":
            log.info("code sandbox: bwrap (namespaces, private file system)")
        else:
            log.warning(
                "code sandbox: %s; install bubblewrap for network and file-system "
                "isolation (see docs/guides/tasks.md, Sandbox)",
                self.sandbox_mode,
            )

    def _task(self, name: str) -> Task:
        return self.tasks.get(name) or load_task(name)

    async def _grade(self, task: str, response: str, answer: Any) -> bool:
        grader = self._task(task)
        self.counts["graded"] += 1
        if grader.screen is None:
            return bool(await self._grade_fully(grader, task, response, answer))
        try:
            question = grader.screen(response, answer)
            key = (task, question)
            hash(key)  # a screen's question must be hashable: a TypeError here is its bug
        except Exception as e:  # a screen bug must not take the service down
            self.counts["errors"] += 1
            log.warning("grader error (%s: %s); scored wrong", type(e).__name__, e)
            return False
        if isinstance(question, bool):
            self.counts["screened"] += 1
            return question
        known = self.verdicts.get(key)
        if known is not None:
            self.counts["reused"] += 1
            self.verdicts.move_to_end(key)
            try:
                return await asyncio.shield(known)
            except asyncio.CancelledError:
                if not known.cancelled():
                    raise  # this request was cancelled
                # The one grading it was cancelled (its request abandoned): grade it here.
                return bool(await self._grade_fully(grader, task, response, answer))
        known = self.verdicts[key] = asyncio.get_running_loop().create_future()
        if len(self.verdicts) > MAX_VERDICTS:
            self.verdicts.popitem(last=False)
        try:
            verdict = await self._grade_fully(grader, task, response, answer)
        except asyncio.CancelledError:
            self.verdicts.pop(key, None)
            known.cancel()
            raise
        known.set_result(bool(verdict))
        if verdict is None:  # failed: the next response that asks is graded afresh
            self.verdicts.pop(key, None)
        return bool(verdict)

    async def _grade_fully(
        self, grader: Task, task: str, response: str, answer: Any
    ) -> bool | None:
        """is_correct's verdict (in the pool, or here for grade_inline), or None where it
        failed (a timeout, a dead process, a grader error: counted, and scored wrong)."""
        try:
            if grader.grade_inline:
                return bool(grader.is_correct(response, answer, **self.options[task]))
            args = (task, response, answer, self.options[task])
            fn: Callable[..., bool] = grade_one
            if task in self.tasks:  # no pool process can load it by name
                fn, args = grade_with, (grader.is_correct, *args[1:])
            async with self.slots:
                future = self.pool.schedule(fn, args, timeout=self.timeout_s)
                with self.grading.computing():
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
        return None

    async def stats(self) -> dict:
        counts, self.counts = self.counts, dict.fromkeys(COUNTS, 0)
        return counts

    def close(self) -> None:
        # stop() kills the processes, so a stuck grading cannot hold up the shutdown.
        self.pool.stop()
        self.pool.join(timeout=30)
