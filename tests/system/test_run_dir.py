"""A finished run is never overwritten: the same command again changes no byte of it,
another config is refused (naming the three ways on), and overwrite=true moves it aside
whole before the new run starts (issue 54)."""

from __future__ import annotations

from areal.config import load_config
from tests.system.test_run import run_train
from tests.unit.test_run_dir import tree_hash

COMMON = ("trial_name=keep", "total_train_steps=2", "model.tiny_warmup_steps=0")


def test_a_rerun_into_a_finished_run_loses_no_byte(tmp_path):
    exp = tmp_path / "tiny/keep"
    first = run_train(tmp_path, *COMMON)
    assert first.returncode == 0, first.stderr[-3000:]
    before = tree_hash(exp)

    again = run_train(tmp_path, *COMMON)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "holds a run with this same config: resuming it" in again.stdout
    assert "is finished (its checkpoint has 2 of 2 steps); nothing was changed" in again.stdout
    assert tree_hash(exp) == before

    lora = run_train(tmp_path, *COMMON, "model.lora.rank=16", timeout=60)
    assert lora.returncode == 2
    assert f"{exp} holds another run" in lora.stderr and "model.lora.rank: 0 -> 16" in lora.stderr
    assert tree_hash(exp) == before

    fresh = run_train(tmp_path, *COMMON, "model.lora.rank=16", "overwrite=true")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    (aside,) = exp.parent.glob("keep.old-*")
    assert f"moved the run that was in {exp} to {aside}" in fresh.stdout
    assert tree_hash(aside) == before
    assert load_config(str(exp / "config.yaml")).model.lora.rank == 16  # the new run
