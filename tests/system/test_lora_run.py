"""A whole LoRA run (model.lora) on the embedded engine: the trainer trains adapters, each
version is the adapter alone, the server merges it and samples with the trainer's
log-probs, the reward rises; resumed from its checkpoint (adapter + Adam state), the run's
server starts from the base and its rollout worker loads the checkpoint's adapter first."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal.checkpoint import load_trainer_state
from areal.config import load_config
from areal.weights import is_adapter_dir
from tests.system.test_run import processes_mentioning, read_metrics, run_train

LORA = ("model.lora.rank=16", "trainer.lr=2e-3")


@pytest.mark.timeout(900)
def test_a_tiny_lora_run_learns_and_resumes_on_its_adapter(tmp_path):
    steps, more = 100, 6
    common = ("trial_name=lora", *LORA, "trainer.save_freq_steps=1000")
    proc = run_train(tmp_path, f"total_train_steps={steps}", *common, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exp_dir = tmp_path / "tiny/lora"
    metrics = read_metrics(exp_dir)
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    # Asynchronous: stale samples. (An adapter update interrupting generation mid-sample:
    # tests/unit/test_lora.py; in this run it is a race, as in test_tiny_run_learns.)
    assert max(m["staleness/max"] for m in metrics) >= 2
    # The server's base + adapter computes the trainer's log-probs (float32 noise only).
    gaps = sorted(m["train/fresh_logprob_diff_max"] for m in metrics if m["train/fresh_tokens"])
    assert gaps and gaps[len(gaps) // 2] < 1e-5 and gaps[-1] < 1e-3, gaps
    rewards = [m["reward/mean"] for m in metrics]
    means = [sum(rewards[i : i + 20]) / 20 for i in range(0, steps - 19, 10)]
    # LoRA learns this task more slowly than full fine-tuning (docs/guides/lora.md).
    assert max(means) > means[0] + 0.6, means
    # A version is the adapter: PEFT's two files, a fraction of the model's bytes.
    (version,) = [p for p in (exp_dir / "weights").iterdir() if p.name == f"v{steps:06d}"]
    assert is_adapter_dir(version)
    assert sorted(p.name for p in version.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]  # fmt: skip
    model_dir = Path(load_config(str(exp_dir / "config.yaml")).model.path)  # the tiny model
    model_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert (version / "adapter_model.safetensors").stat().st_size * 2 < model_bytes
    ckpt = exp_dir / f"checkpoints/v{steps:06d}"
    assert is_adapter_dir(ckpt / "model") and (ckpt / "optimizer-tp0-pp0.safetensors").exists()
    assert load_trainer_state(ckpt)["lora_rank"] == 16

    proc = run_train(
        tmp_path, f"total_train_steps={steps + more}", "resume=true", *common, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(exp_dir)
    assert [m["version"] for m in metrics] == list(range(1, steps + more + 1))
    # Its server started from the base; its rollout worker loaded the checkpoint's adapter
    # (as version `steps`) before it took any request (tests/unit/test_lora.py: an engine
    # given an adapter directory computes the trainer's log-probs).
    first = (exp_dir / "logs/rollout0.log").read_text().splitlines()[0]
    assert f"loaded version {steps} in" in first, first
    assert processes_mentioning(str(tmp_path)) == []
