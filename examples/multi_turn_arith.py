"""A multi-turn agent: answer a sum; on a wrong answer, hear "wrong, try again" and retry.

    python -m areal.train --config configs/multi_turn.yaml

Plain agent code: it talks to the model through the OpenAI client it is given and imports
nothing of areal's. Each call is rewarded on its own (+5 right, -5 wrong, keyed by the
completion's id); the run turns these into returns with rollout.turn_discount, so a wrong
first answer followed by a right one scores -5 + 0.5 * 5 = -2.5 and a right first one +5.
"""

from __future__ import annotations

import re

MAX_TURNS = 3  # configs/multi_turn.yaml sets rollout.max_turns to the same
RIGHT, WRONG = 5.0, -5.0
FEEDBACK = "wrong, try again"


def is_right(text: str, answer: str) -> bool:
    numbers = re.findall(r"-?\d+", text)
    return bool(numbers) and numbers[-1] == answer.strip()


async def run(data: dict, client) -> dict[str, float]:
    messages = [{"role": "user", "content": data["prompt"]}]
    rewards: dict[str, float] = {}
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="default", messages=messages)
        text = reply.choices[0].message.content
        right = is_right(text, data["answer"])
        rewards[reply.id] = RIGHT if right else WRONG
        if right:
            break
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": FEEDBACK},
        ]
    return rewards
