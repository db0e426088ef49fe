"""The reward service with its real process pool: math and code verdicts, timeouts and
errors counted, one slow response never costs the others their verdict."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest

from areal.config import ConfigError, RewardConfig
from areal.reward.service import RewardService
from areal.tasks import Task

# sympy expands the tower: this comparison runs for minutes unless someone kills it.
HANG = r"\boxed{10^{10^{10}}}"


def one(i: int) -> str:
    """A right answer to gold "1" that only math-verify recognises: graded in the pool."""
    return rf"\boxed{{\frac{{{i}}}{{{i}}}}}"


def counts_of(graded=0, screened=0, reused=0, timeouts=0, errors=0) -> dict:
    return {
        "graded": graded, "screened": screened, "reused": reused,
        "timeouts": timeouts, "errors": errors,
    }  # fmt: skip


def _shouted(response: str, answer: str, suffix: str = "") -> bool:
    if os.getpid() == MAIN_PID:
        raise AssertionError("graded outside the pool")
    return response == answer.upper() + suffix


MAIN_PID = os.getpid()
SHOUT = Task(
    name="shout",
    generate=lambda cfg, seed: [{"prompt": "say hi loudly", "answer": "hi"}],
    is_correct=_shouted,
    grader_options=lambda reward_cfg: {"suffix": "!" * int(reward_cfg.code_memory_mb == 7)},
)
"""A task of one's own, named "tests.system.test_reward_service:SHOUT" by its rows."""


def service(**kw) -> RewardService:
    args = {"n_workers": 2, "timeout_s": 10.0, "correct": 5.0, "wrong": -5.0}
    return RewardService(RewardConfig(**{**args, **kw}))


def test_math_rewards_are_plus_and_minus_five_and_certain_verdicts_skip_the_pool():
    async def go():
        s = service()
        try:
            responses = [
                r"so \boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{2}", "garbage",
                r"\boxed{ 1 / 2 }", r"then \boxed{0.5}",
            ]  # fmt: skip
            rewards = await s.grade("math", responses, "1/2")
            return rewards, await s.stats()
        finally:
            s.close()

    rewards, counts = asyncio.run(go())
    assert rewards == [5.0, 5.0, -5.0, -5.0, 5.0, 5.0]
    # No box and the gold's own string need no sympy; the second 0.5 reuses the first's verdict.
    assert counts == counts_of(graded=6, screened=2, reused=1)


def test_a_grading_timeout_scores_wrong_is_counted_and_spares_the_others():
    async def go():
        s = service(timeout_s=1.5)
        try:
            t0 = time.time()
            rewards = await s.grade("math", [HANG, one(2), one(3), r"\boxed{\frac{4}{5}}"], "1")
            elapsed = time.time() - t0
            first = await s.stats()
            # The pool keeps grading; the question that timed out is asked afresh.
            again = await s.grade("math", [one(5), HANG], "1")
            return rewards, elapsed, first, again, await s.stats()
        finally:
            s.close()

    rewards, elapsed, first, again, second = asyncio.run(go())
    assert rewards == [-5.0, 5.0, 5.0, -5.0]
    assert elapsed < 15  # not the hung grading's full run
    assert first == counts_of(graded=4, timeouts=1)
    assert again == [5.0, -5.0]
    assert second == counts_of(graded=2, timeouts=1)  # stats() resets the counts


def test_queueing_for_a_busy_pool_is_not_a_timeout():
    """More responses than processes: each one's time limit counts only its own grading."""

    async def go():
        s = service(n_workers=1, timeout_s=1.5)
        try:
            # About 0.4 s each, 3 s for all: submitted at once, the last would time out.
            slow = "```python\nimport time\ntime.sleep(0.3)\nprint(1)\n```"
            t0 = time.time()
            rewards = await s.grade("code", [slow] * 8, [{"input": "", "output": "1"}])
            return rewards, time.time() - t0, await s.stats()
        finally:
            s.close()

    rewards, elapsed, counts = asyncio.run(go())
    assert elapsed > 1.5  # the premise: all of them took longer than one time limit
    assert rewards == [5.0] * 8
    assert counts["timeouts"] == 0


def test_a_grader_error_scores_wrong_and_is_counted():
    async def go():
        s = service()
        try:
            # An unreadable gold answer (a data problem) and code tests of an unknown form.
            math = await s.grade("math", [r"\boxed{1}"], "")
            code = await s.grade("code", ["```python\nprint(1)\n```"], {"tests": "?"})
            return math, code, await s.stats()
        finally:
            s.close()

    math, code, counts = asyncio.run(go())
    assert math == [-5.0] and code == [-5.0]
    assert counts == counts_of(graded=2, errors=2)


def test_code_slower_than_the_service_limit_is_a_timeout():
    async def go():
        s = service(timeout_s=1.0, code_time_limit_s=5.0)
        try:
            slow = "```python\nimport time\ntime.sleep(3)\nprint(1)\n```"
            rewards = await s.grade("code", [slow], [{"input": "", "output": "1"}])
            return rewards, await s.stats()
        finally:
            s.close()

    rewards, counts = asyncio.run(go())
    assert rewards == [-5.0]
    assert counts["timeouts"] == 1


def _children() -> set[int]:
    me = os.getpid()
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = open(f"/proc/{entry.name}/stat").read()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == me and state != "Z":  # a killed process not yet reaped is no worker
                found.add(int(entry.name))
    return found


def test_a_timeout_replaces_only_the_stuck_grading_process():
    """The other grading processes keep running: a timeout kills one process, not the pool."""

    others = _children()  # processes earlier tests of this session left to die: not the pool's

    async def children_when(ok) -> set[int]:
        # Processes start, die and are reaped at their own pace on a loaded machine.
        deadline = time.monotonic() + 30
        while not ok(found := _children() - others) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return found

    async def go():
        # A limit well above a normal grading's time on a loaded machine (its first one
        # imports math-verify), so that only the hanging one is cut.
        s = service(n_workers=2, timeout_s=6.0)
        try:
            await s.grade("math", [one(2), one(3)], "1")
            before = await children_when(lambda c: len(c) == 2)
            rewards = await s.grade("math", [HANG, one(4)], "1")
            await s.grade("math", [one(5), one(6)], "1")
            after = await children_when(lambda c: len(before - c) == 1)
            return before, after, rewards, await s.stats()
        finally:
            s.close()

    before, after, rewards, counts = asyncio.run(go())
    assert rewards == [-5.0, 5.0] and counts["timeouts"] == 1
    assert len(before) == 2
    # The stuck process is gone and the other one kept (a pool restart would replace both).
    assert len(before - after) == 1 and len(before & after) == 1, (before, after)


def test_a_task_of_ones_own_is_graded_in_the_pool_with_its_options():
    async def go():
        s = service(code_memory_mb=7)
        try:
            rewards = await s.grade(f"{__name__}:SHOUT", ["HI!", "HI", "hi!"], "hi")
            with pytest.raises(ConfigError, match="unknown task 'shout'"):
                await s.grade("shout", ["HI!"], "hi")
            return rewards, await s.stats()
        finally:
            s.close()

    rewards, counts = asyncio.run(go())
    assert rewards == [5.0, -5.0, -5.0]
    assert counts == counts_of(graded=3)


def test_a_task_given_as_an_object_is_graded_in_the_pool_under_its_own_name():
    """areal.build's tasks: no name loads them, so the grader travels to the pool (pickled
    by reference); the object takes precedence over a built-in task of the same name."""

    async def go():
        s = RewardService(
            RewardConfig(n_workers=2, timeout_s=10.0, correct=5.0, wrong=-5.0, code_memory_mb=7),
            {"arith": dataclasses.replace(SHOUT, name="arith")},
        )
        try:
            return await s.grade("arith", ["HI!", "HI", "7"], "hi"), await s.stats()
        finally:
            s.close()

    rewards, counts = asyncio.run(go())
    assert rewards == [5.0, -5.0, -5.0]  # _shouted raises outside the pool: it ran there
    assert counts == counts_of(graded=3)


def _shouted_here(response: str, answer: str, suffix: str = "") -> bool:
    if os.getpid() != MAIN_PID:
        raise AssertionError("graded in the pool")
    if response == "boom":
        raise ValueError("a grader bug")
    return response == answer.upper() + suffix


SHOUT_INLINE = dataclasses.replace(SHOUT, is_correct=_shouted_here, grade_inline=True)


def test_an_inline_grader_runs_in_the_service_with_its_options_and_errors_counted():
    async def go():
        s = service(code_memory_mb=7)
        try:
            rewards = await s.grade(f"{__name__}:SHOUT_INLINE", ["HI!", "HI", "boom"], "hi")
            arith = await s.grade("arith", ["so 7", "8"], "7")  # a built-in inline grader
            return rewards, arith, await s.stats()
        finally:
            s.close()

    rewards, arith, counts = asyncio.run(go())
    assert rewards == [5.0, -5.0, -5.0] and arith == [5.0, -5.0]
    assert counts == counts_of(graded=5, errors=1)


def _slowly_shouted(response: str, answer: str, suffix: str = "") -> bool:
    time.sleep(1.0)
    return response == answer.upper()


SLOW_SHOUT = dataclasses.replace(SHOUT, is_correct=_slowly_shouted, screen=lambda r, a: (r, a))
"""Every response a question for the pool, graded in a second."""


def test_a_cancelled_grading_leaves_no_question_waiting_forever():
    """The request grading a question is abandoned: the responses that wait for its verdict
    grade it themselves, and a later response asking the same is graded afresh."""

    async def go():
        s = service(timeout_s=20.0)
        task = f"{__name__}:SLOW_SHOUT"
        try:
            first = asyncio.create_task(s.grade(task, ["HI"], "hi"))
            await asyncio.sleep(0.3)  # its question is being graded in the pool
            waiting = asyncio.create_task(s.grade(task, ["HI"], "hi"))
            await asyncio.sleep(0.05)
            first.cancel()
            later = await asyncio.wait_for(waiting, 20)
            again = await asyncio.wait_for(s.grade(task, ["HI"], "hi"), 20)
            return later, again, first.cancelled(), await s.stats()
        finally:
            s.close()

    later, again, cancelled, counts = asyncio.run(go())
    assert cancelled and later == [5.0] and again == [5.0]
    assert counts["reused"] == 1  # the waiting one; the later one was graded afresh
