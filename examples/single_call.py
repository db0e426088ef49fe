"""The single-turn episode written as an agent: one call through the OpenAI client, graded
by the agent (the arith task's check, +5 right, -5 wrong, as the reward service scores it).

    python -m areal.train --config configs/tiny.yaml rollout.workflow=examples.single_call:run

benchmarks/agent_endpoint.py trains it against the built-in single-turn workflow on the
same model and task: the difference is what the endpoint and the agent process cost.
"""

from __future__ import annotations

from areal.tasks.arith import is_correct

RIGHT, WRONG = 5.0, -5.0


async def run(data: dict, client) -> float:
    reply = await client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": data["prompt"]}]
    )
    return RIGHT if is_correct(reply.choices[0].message.content or "", data["answer"]) else WRONG
