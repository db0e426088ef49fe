"""The synthetic task of the tiny CPU default: add two small numbers.

A prompt is "17+25=" and the verifiable answer "42". The tiny model starts out knowing the
format (digits, then end of turn) but mostly not the sums, so the reward starts low and RL
visibly raises it within minutes on two CPU cores.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from areal.config import DatasetConfig
from areal.config_loader import Section
from areal.tasks import Batch, Task

_LAST_INT = re.compile(r"-?\d+")


@dataclass(kw_only=True)
class ArithOptions(Section):
    """dataset.options of the arith task."""

    _section: ClassVar[str] = "dataset.options"

    max_operand: int = 5
    """Largest operand (sums of 0..5 are learnt by the tiny model in minutes)."""

    def __post_init__(self) -> None:
        self._check_types()
        self._positive("max_operand")


def make_problems(n: int, max_operand: int, seed: int) -> list[dict]:
    """n problems {"prompt", "answer"} drawn with a fixed seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def is_correct(response: str, answer: str) -> bool:
    """True when the last integer in the response equals the answer."""
    found = _LAST_INT.findall(response)
    return bool(found) and found[-1] == answer.strip()


def warmup(dataset_cfg: DatasetConfig, seed: int) -> Iterator[Batch]:
    """Sums whose answer is replaced by a random number half of the time: the model learns
    the format and only part of the arithmetic."""
    rng = random.Random(seed + 1)
    max_operand = TASK.options_of(dataset_cfg.options).max_operand
    pool = make_problems(4096, max_operand, seed + 1)
    while True:
        batch = []
        for p in rng.sample(pool, 64):
            answer = p["answer"] if rng.random() < 0.5 else str(rng.randint(0, 2 * max_operand))
            batch.append((p["prompt"], answer))
        yield batch


def generate(dataset_cfg: DatasetConfig, seed: int) -> list[dict]:
    max_operand = TASK.options_of(dataset_cfg.options).max_operand
    return make_problems(dataset_cfg.n_problems, max_operand, seed)


TASK = Task(
    name="arith",
    generate=generate,
    is_correct=is_correct,
    grade_inline=True,
    warmup=warmup,
    options=ArithOptions,
)
