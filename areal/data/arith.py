"""The synthetic task of the tiny CPU default: add two small numbers.

A prompt is "17+25=" and the verifiable answer "42". The tiny model starts out knowing the
format (digits, then end of turn) but mostly not the sums, so the reward starts low and RL
visibly raises it within minutes on two CPU cores.
"""

from __future__ import annotations

import random
import re

_LAST_INT = re.compile(r"-?\d+")


def make_problems(n: int, max_operand: int, seed: int) -> list[dict]:
    """n problems {"prompt", "answer", "task"} drawn with a fixed seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "task": "arith"})
    return rows


def is_correct(response: str, answer: str) -> bool:
    """True when the last integer in the response equals the answer."""
    found = _LAST_INT.findall(response)
    return bool(found) and found[-1] == answer.strip()
