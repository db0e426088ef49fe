"""areal.build from objects: examples/rl_from_objects.py's run learns, in this process, and
its loss is where docs/concepts/architecture.md says, below the script's loop."""

from __future__ import annotations

import sys
import threading

import pytest

import areal
from areal.config import ConfigError
from areal.models.tiny import build_tiny_model
from areal.trainer import ppo
from examples import rl_from_objects

# The frames from the script's loop down to the loss, as documented (architecture.md).
CHAIN = [
    "ppo_update",  # trainer/step.py: the minibatch loop, one optimizer step each (run.ppo_update)
    "MicroBatchLoops.forward_backward",  # trainer/batching.py: the micro-batch loop
    "PolicyLoss.__call__",  # trainer/ppo_batch.py: micro-batch k's tensors
    "policy_loss",  # trainer/ppo.py: the objective
]
MAX_DEPTH = 4  # issue 57's target: a breakpoint in the loss at most 4 calls below the loop


@pytest.mark.timeout(120)
def test_the_example_learns_and_its_loss_is_under_the_loop(tmp_path, monkeypatch):
    chains: list[tuple[str, list[str]]] = []
    real_loss = ppo.policy_loss

    def loss(*args, **kwargs):  # where a researcher puts a breakpoint
        # The frames a debugger's "up" walks from here to the script's loop.
        frame, names = sys._getframe(), []
        while frame is not None and frame.f_code is not rl_from_objects.main.__code__:
            names.append(frame.f_code.co_qualname)
            frame = frame.f_back
        assert frame is not None, f"the loss ran outside the script's loop: {names}"
        chains.append((threading.current_thread().name, ["policy_loss", *names[1:]][::-1]))
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(ppo, "policy_loss", loss)
    rewards = rl_from_objects.main(steps=10, fileroot=str(tmp_path))
    assert len(rewards) == 10
    # The reward starts near 0 (half the numbers are even) and the run learns to say even
    # ones (about +4 of +5 by step 10 in runs of this test); asynchrony varies the batches.
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 1.0, rewards
    assert chains, "the loss never ran"
    thread, chain = chains[0]
    assert thread == threading.current_thread().name  # the loop's thread: step into it
    assert len(chain) <= MAX_DEPTH, chain
    assert chain == CHAIN, chain
    assert (tmp_path / "tiny" / "run0" / "metrics.jsonl").read_text().count("\n") == 10


@pytest.mark.timeout(60)
def test_build_says_what_is_wrong(tmp_path):
    model, tokenizer = build_tiny_model(warmup_steps=0)
    config = [f"fileroot={tmp_path}"]
    with pytest.raises(ValueError, match="needs its tokenizer"):
        areal.build(model, None, "arith", config)
    with pytest.raises(TypeError, match="task must be"):
        areal.build(model, tokenizer, 42, config)
    with pytest.raises(TypeError, match="model must be"):
        areal.build(object(), tokenizer, "arith", config)
    with pytest.raises(ConfigError, match="one torch rank"):
        areal.build(model, tokenizer, "arith", [*config, "trainer.parallel.dp=2"])
    assert not (tmp_path / "tiny").exists()  # refused before the run's directory is made


@pytest.mark.timeout(120)
def test_the_phases_publish_each_batch_once(tmp_path):
    model, tokenizer = build_tiny_model(warmup_steps=0)
    config = [
        f"fileroot={tmp_path}", "trainer.batch_size=4", "rollout.group_size=2",
        "trainer.save_freq_steps=0",
    ]  # fmt: skip
    with areal.build(model, tokenizer, "arith", config) as run:
        batch = run.next_batch()
        stats = run.ppo_update(batch)
        line = run.publish(batch, stats)
        assert line["version"] == run.version == 1
        assert "reward/mean" in stats  # the caller's statistics, left as they were
        with pytest.raises(RuntimeError, match="batch of the last next_batch"):
            run.publish(batch, stats)  # a version per update, never two
        assert run.version == 1
        assert run.step()["version"] == 2  # the three at once
