"""Graded responses per second through the RewardService: math graded as areal grades it
(screened, math-verify's verdicts reused) against math-verify for every response as before;
math against code, pool of 1 against a pool of --workers; side by side in one run.

    python benchmarks/grading.py [--responses 64] [--workers 2]

Screening, two math workloads: "policy", the answers of a policy learning the tiny math
task (sums asked in words, benchmarks/vs_trl.py --task math): a group's 8 answers to one
prompt, the gold sum half of the time, another small integer otherwise, one in ten without
a box; "forms", every response a distinct equivalent form (fractions, sets, intervals,
radicals, polynomials; one wrong), which only math-verify can grade. For each: responses/s
with and without screening, the share graded without the pool (screened or reused), and
whether every verdict is the same.

Math responses are boxed answers in varied equivalent forms (as a policy writes them after
long reasoning); code responses are correct programs run against the sample rows' tests in
the sandbox (every test runs, as a correct answer makes them). Each figure is the whole
path the controller uses: RPC-free `grade()` calls on the service, in groups of 8, as the
controller sends them, all groups submitted at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from pathlib import Path

from areal.config import RewardConfig
from areal.reward.service import RewardService
from areal.tasks import load_task
from areal.tasks.graders import sandbox
from areal.tasks.graders.math import MAX_ANSWER_CHARS, last_boxed, verify_answer

ROOT = Path(__file__).resolve().parents[1]
GROUP = 8

# (gold, response) makers; i makes every response distinct, so no cache inside math-verify
# or sympy answers a repeated question.
MATH = [
    lambda i: (rf"\frac{{{i}}}{{4}}", rf"... so the answer is $\boxed{{{i / 4}}}$."),
    lambda i: (f"{i}", rf"There are \boxed{{{i}}} divisors."),
    lambda i: (rf"\{{-{i}, {i}\}}", rf"\boxed{{\{{{i}, -{i}\}}}}"),
    lambda i: (f"(1, {i + 2})", rf"Hence $x \in \boxed{{(1,{i + 2})}}$."),
    lambda i: (rf"{i}\sqrt{{2}}", rf"\boxed{{\sqrt{{{2 * i * i}}}}}"),
    lambda i: (f"x^2 + {i}x", rf"\boxed{{x(x+{i})}}"),
    lambda i: (f"{i}", rf"\boxed{{{i + 1}}}"),  # a wrong one
    lambda i: (rf"\frac{{{i}}}{{{i + 1}}}", rf"\boxed{{\dfrac{{{i}}}{{{i + 1}}}}}"),
]
CODE = [
    "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "```python\nn = int(input())\nprint(*sorted(map(int, input().split())))\n```",
    "```python\ndef add(a, b):\n    return a + b\n```",
    "```python\nclass Solution:\n    def maxOf(self, nums):\n        return max(nums)\n```",
    "```python\nprint(input()[::-1])\n```",
]


def math_verify_only(response: str, gold: str) -> bool:
    """Math grading before screening: every boxed answer to math-verify, nothing kept."""
    answer = last_boxed(response)
    if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return False
    return verify_answer.__wrapped__(answer, gold)


MATH_UNSCREENED = dataclasses.replace(
    load_task("math"), name="math_unscreened", screen=None, is_correct=math_verify_only
)
"""The "before" variant, loaded by the pool as grading:MATH_UNSCREENED."""


def workload(task: str, n: int, first: int = 1) -> list[tuple[list[str], object]]:
    """Groups (responses, answer) of GROUP responses each, n responses in all."""
    groups = []
    if task == "policy":
        rng = random.Random(first)
        for _ in range(n // GROUP):
            a, b = rng.randint(0, 5), rng.randint(0, 5)
            answers = [a + b if rng.random() < 0.5 else rng.randint(0, 10) for _ in range(GROUP)]
            steps = f"We add {a} and {b}: {a} + {b} = "
            responses = [
                f"{steps}{x}. The answer is "
                + (rf"\boxed{{{x}}}." if rng.random() < 0.9 else f"{x}.")
                for x in answers
            ]
            groups.append((responses, str(a + b)))
    elif task in ("math", "forms"):
        filler = "Let me think step by step. " * 200  # long reasoning before the answer
        for g in range(n // GROUP):
            make = MATH[g % len(MATH)]
            i0 = first + g * GROUP
            # A group shares its prompt's gold answer; each response answers its own i.
            gold = make(i0)[0]
            groups.append(([filler + make(i0 + j)[1] for j in range(GROUP)], gold))
    else:
        rows = [json.loads(x) for x in (ROOT / "tests/data/code_sample.jsonl").open()]
        for g in range(n // GROUP):
            j = g % len(rows)
            groups.append(([CODE[j]] * GROUP, rows[j]["tests"]))
    return groups


async def measure(task: str, n: int, workers: int, grader: str = "") -> dict:
    """`task`: the workload; `grader`: the task that grades it (default: the workload's)."""
    grader = grader or {"policy": "math", "forms": "math"}.get(task, task)
    service = RewardService(
        RewardConfig(n_workers=workers, timeout_s=30.0, correct=5.0, wrong=-5.0)
    )
    try:
        # Warm-up, the workload once: every pool process starts, imports its grader and
        # fills math-verify's caches (sympy and the LaTeX parser are slow the first time).
        warm = workload(task, n, first=100_000)
        await asyncio.gather(*(service.grade(grader, r, a) for r, a in warm))
        await service.stats()
        groups = workload(task, n)
        t0 = time.perf_counter()
        rewards = await asyncio.gather(*(service.grade(grader, r, a) for r, a in groups))
        seconds = time.perf_counter() - t0
        counts = await service.stats()
    finally:
        service.close()
    flat = [r for g in rewards for r in g]
    return {
        "per_s": len(flat) / seconds,
        "seconds": seconds,
        "correct": sum(r > 0 for r in flat) / len(flat),
        "timeouts": counts["timeouts"],
        "errors": counts["errors"],
        "without_pool": (counts["screened"] + counts["reused"]) / counts["graded"],
        "rewards": flat,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=64, help="responses per variant")
    parser.add_argument("--workers", type=int, default=2, help="pool size of the n variant")
    args = parser.parse_args()
    print(f"sandbox: {sandbox.mode()}; {args.responses} responses per variant, groups of {GROUP}")
    w = args.workers
    print(f"math screening (pool of {w}):")
    print(f"{'workload':<9} {'before /s':>10} {'after /s':>10} {'ratio':>7} {'no pool':>8} same")
    for task in ("policy", "forms"):
        before = asyncio.run(measure(task, args.responses, w, "grading:MATH_UNSCREENED"))
        after = asyncio.run(measure(task, args.responses, w))
        print(
            f"{task:<9} {before['per_s']:>10.1f} {after['per_s']:>10.1f} "
            f"{after['per_s'] / before['per_s']:>6.1f}x {after['without_pool']:>8.0%} "
            f"{before['rewards'] == after['rewards']}"
        )
    results = {}
    for task in ("math", "code"):
        for workers in (1, args.workers):
            results[task, workers] = asyncio.run(measure(task, args.responses, workers))
    header = f"{'task':<6} {'pool':>5} {'responses/s':>12} {'seconds':>8} {'correct':>8}"
    print(f"{header} {'t/o,err':>8}")
    for (task, workers), m in results.items():
        print(
            f"{task:<6} {workers:>5} {m['per_s']:>12.1f} {m['seconds']:>8.2f} "
            f"{m['correct']:>8.2f} {m['timeouts']:>4},{m['errors']:<3}"
        )
    for task in ("math", "code"):
        ratio = results[task, w]["per_s"] / results[task, 1]["per_s"]
        print(f"{task}: pool of {w} / pool of 1: {ratio:.2f}x")
    ratio = results["math", w]["per_s"] / results["code", w]["per_s"]
    print(f"math / code responses per second (pool of {w}): {ratio:.2f}x")


if __name__ == "__main__":
    main()
