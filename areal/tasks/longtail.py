"""A reasoning-shaped synthetic task with long-tailed output lengths: repeated addition.

The prompt "add 3 to 15, 12 times" asks for 15 + 12 * 3, and the answer is reached one
addition at a time, a scratchpad line per step: the steps left (two digits), the addend,
then the running total (three digits):

    11 +3 018
    10 +3 021
    ...
    00 +3 051

The last line's total is the answer; grading looks at the final answer only (the last
integer of the response), as the paper's math grader does. Every line follows from the one
above (a decrement, an addition with carries), so a tiny transformer can learn the rule.

The number of steps is heavy-tailed, as reasoning lengths are: floor(2 X) with X
Pareto(alpha = 1.1), capped at 50. Responses (10 tokens a step) have a median of 30 tokens
and a p99 of 500 (see `length_quantiles`): a tail like the paper's, whose answers run
from hundreds to 27K tokens.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from areal.config import DatasetConfig
from areal.tasks import Batch, Task

ALPHA = 1.1  # the Pareto tail index of the number of steps
SCALE = 2.0
MAX_STEPS = 50
MAX_ADDEND = 3  # the tiny model learns these 30 sums in ~1,000 warm-up steps; 1..9 takes far longer
MAX_START = 20  # totals stay below 20 + 50 * 9 (warm-up's wrong addends too): three digits
TOKENS_PER_STEP = 10  # "kk +d vvv\n": digits are single tokens in the tiny tokenizer
WARMUP_NOISE = 0.1  # the share of wrong additions in the supervised warm-up's answers
_LAST_INT = re.compile(r"-?\d+")


def draw_steps(rng: random.Random) -> int:
    """Steps of one problem: floor(SCALE * Pareto(ALPHA)), in [SCALE, MAX_STEPS]."""
    return min(MAX_STEPS, int(SCALE * rng.paretovariate(ALPHA)))


def prompt_text(start: int, addend: int, steps: int) -> str:
    return f"add {addend} to {start}, {steps} times"


def scratchpad(
    start: int, addend: int, steps: int, rng: random.Random | None = None, noise: float = 0.0
) -> str:
    """The worked solution. With noise > 0 (warm-up data), each addition is wrong with that
    probability and the chain goes on from the wrong total, so a model trained on it knows
    the format and most of the rule, and RL has room to raise the reward."""
    lines, total = [], start
    for left in range(steps - 1, -1, -1):
        step = addend
        if noise and rng.random() < noise:
            step = rng.choice([a for a in range(1, 10) if a != addend])
        total += step
        lines.append(f"{left:02d} +{addend} {total:03d}")
    return "\n".join(lines)


def make_problems(n: int, seed: int) -> list[dict]:
    """n problems {"prompt", "answer"} drawn with a fixed seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start, addend = rng.randint(0, MAX_START), rng.randint(1, MAX_ADDEND)
        steps = draw_steps(rng)
        rows.append(
            {
                "prompt": prompt_text(start, addend, steps),
                "answer": str(start + steps * addend),
            }
        )
    return rows


def is_correct(response: str, answer: str) -> bool:
    """True when the last integer of the response has the answer's value ("099" = "99")."""
    found = _LAST_INT.findall(response)
    return bool(found) and int(found[-1]) == int(answer)


def length_quantiles(n: int = 20000, seed: int = 0) -> dict[str, float]:
    """Quantiles of the response length in tokens (TOKENS_PER_STEP per step, end of turn)."""
    rng = random.Random(seed)
    lengths = sorted(TOKENS_PER_STEP * draw_steps(rng) for _ in range(n))
    return {q: lengths[int(p * (n - 1))] for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}


def warmup_batch(rng: random.Random) -> Batch:
    """Repeated additions with a wrong step now and then (WARMUP_NOISE). One batch has
    similar lengths (little padding); its length is the task's own heavy-tailed draw or, as
    often as it takes to teach every counter and position, a uniform one."""
    top = draw_steps(rng) if rng.random() < 0.7 else rng.randint(1, MAX_STEPS)
    rows = []
    for _ in range(32):
        start, addend = rng.randint(0, MAX_START), rng.randint(1, MAX_ADDEND)
        steps = rng.randint(max(1, top - 8), top)
        pad = scratchpad(start, addend, steps, rng, WARMUP_NOISE)
        rows.append((prompt_text(start, addend, steps), pad))
    return rows


def warmup(dataset_cfg: DatasetConfig, seed: int) -> Iterator[Batch]:
    rng = random.Random(seed + 1)
    while True:
        yield warmup_batch(rng)


def generate(dataset_cfg: DatasetConfig, seed: int) -> list[dict]:
    return make_problems(dataset_cfg.n_problems, seed)


TASK = Task(
    name="longtail", generate=generate, is_correct=is_correct, grade_inline=True, warmup=warmup
)
