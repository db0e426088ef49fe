"""Recipes in whole runs: `ppo.recipe=...` as a user writes it, through every process."""

from __future__ import annotations

import json

from tests.system.test_run import processes_mentioning, read_metrics, run_train


def test_grpo_with_dynamic_sampling_entropy_and_approximate_proximal(tmp_path):
    """One run through the launcher with the knobs that reach beyond the loss: the
    reference model (KL in the loss), dynamic sampling in the controller, the entropy
    stream of the backend, and prox_approx (no proximal pass)."""
    steps = 10
    proc = run_train(
        tmp_path,
        f"total_train_steps={steps}",
        "trial_name=grpo",
        "ppo.recipe=grpo",
        "ppo.dynamic_sampling=true",
        "ppo.entropy_coef=0.001",
        "ppo.prox_approx=loglinear",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The launcher says which objective it runs, resolved, in one line.
    line = next(x for x in proc.stdout.splitlines() if x.startswith("areal: objective"))
    for part in ("recipe=grpo", "adv=grpo", "agg=seq_mean_token_mean", "kl=0.04*k3 in loss"):
        assert part in line, line
    assert "dynamic_sampling" in line and "prox_approx=loglinear" in line
    exp = tmp_path / "tiny/grpo"
    metrics = read_metrics(exp)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    # The reference policy is the initial weights: KL 0 before the first update, then not.
    assert all(m["time/reference_s"] > 0 for m in metrics)
    assert metrics[-1]["loss/kl_ref"] > 0
    assert all(m["loss/entropy"] > 0 for m in metrics)
    assert all("train/prox_approx_gap_max" in m for m in metrics)
    # Short answers in float32: about 1e-6; 1e-3 leaves room for a rare token.
    assert max(m["train/fresh_logprob_diff_max"] for m in metrics) < 1e-3
    # Dynamic sampling: groups of equal rewards were generated, dropped, and none trained.
    assert sum(m["rollout/dropped_groups"] for m in metrics) > 0
    # The reward of everything generated, dropped groups too, beside the trained batch's.
    assert all(-5 <= m["rollout/reward_mean"] <= 5 for m in metrics if "rollout/reward_mean" in m)
    assert sum("rollout/reward_mean" in m for m in metrics) >= steps // 2
    group = 8
    for line in (exp / "batches.jsonl").read_text().splitlines():
        rewards = json.loads(line)["reward"]
        assert len(rewards) == 16 * group
        groups = [rewards[k : k + group] for k in range(0, len(rewards), group)]
        assert all(len(set(g)) > 1 for g in groups)
    assert all(m["staleness/max"] <= 4 for m in metrics)  # the bound is unchanged
    assert processes_mentioning(str(tmp_path)) == []


def test_ppo_with_a_critic_runs_and_resumes(tmp_path):
    """ppo.recipe=ppo through every process: the critic's statistics on every step, its
    weights and optimizer in the checkpoint, and a resume that continues from them (the
    restored critic's values are those it had learned, not a fresh head's zeros)."""
    steps, more = 6, 2
    common = ("trial_name=ppo", "ppo.recipe=ppo")
    proc = run_train(tmp_path, f"total_train_steps={steps}", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("areal: objective"))
    assert "recipe=ppo" in line and "adv=gae[gamma=1, lam=0.95, batch]" in line
    assert any(x.startswith("areal: critic on: the policy") for x in proc.stdout.splitlines())
    exp = tmp_path / "tiny/ppo"
    metrics = read_metrics(exp)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    keys = ("values_mean", "returns_mean", "explained_var", "value_loss", "clipfrac")
    for m in metrics:
        assert all(abs(m[f"critic/{k}"]) < 100 for k in keys), m
    assert metrics[0]["critic/values_mean"] == 0.0  # the zero head
    assert metrics[-1]["critic/values_mean"] != 0.0
    ckpt = exp / f"checkpoints/v{steps:06d}"
    assert (ckpt / "critic.safetensors").exists() and (ckpt / "critic.json").exists()

    proc = run_train(tmp_path, f"total_train_steps={steps + more}", "resume=true", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(exp)
    assert [m["step"] for m in metrics] == list(range(1, steps + more + 1))
    assert metrics[steps]["critic/values_mean"] != 0.0  # the restored critic, not a new one
    assert processes_mentioning(str(tmp_path)) == []
