"""RL from objects, in one process: your model, your reward, your loop.

    python examples/rl_from_objects.py [steps]

Edit `reward` (any function of the response and the row's answer) or the loop. The model is
the tiny one, made in memory (no download); pass your own causal LM and tokenizer instead.
Each step trains one version while the engine goes on generating the next batches, at most
max_staleness versions behind (`run.step()` does the loop body's three calls at once). The
loss is 4 calls below the loop: run.ppo_update -> forward_backward -> PolicyLoss ->
ppo.policy_loss (a breakpoint there stops the trainer; generation goes on in its threads;
docs/concepts/architecture.md).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import tempfile

import areal
from areal.models.tiny import build_tiny_model
from areal.tasks import load_task


def reward(response: str, answer: str) -> bool:
    """Yours to change. Here: answer with an even number (whatever the sum is)."""
    numbers = re.findall(r"\d+", response)
    return bool(numbers) and int(numbers[-1]) % 2 == 0


def main(steps: int = 12, fileroot: str | None = None) -> list[float]:
    model, tokenizer = build_tiny_model(seed=1, warmup_steps=20)  # knows the answer format
    # The arith prompts ("3+4="), graded by your reward, in the service's own process.
    task = dataclasses.replace(load_task("arith"), is_correct=reward, grade_inline=True)
    config = [
        f"fileroot={fileroot or tempfile.mkdtemp()}", f"total_train_steps={steps}",
        "max_staleness=2", "trainer.batch_size=8", "rollout.group_size=8",
        "trainer.lr=3e-3", "ppo.n_minibatches=2", "trainer.save_freq_steps=0",
    ]  # fmt: skip
    rewards = []
    with areal.build(model, tokenizer, task, config) as run:
        for step in range(steps):  # your loop: stop, evaluate, change data between steps
            batch = run.next_batch()  # the oldest allowed, with proximal log-probs, advantages
            stats = run.ppo_update(batch)  # the minibatch updates: the loss is in here
            line = run.publish(batch, stats)  # v(step+1) to the engine; metrics.jsonl
            rewards.append(line["reward/mean"])
            print(f"step {step + 1}: reward {rewards[-1]:+.2f}, staleness {line['staleness/max']}")
    return rewards


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
