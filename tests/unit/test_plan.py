"""The placement plan: the paper's split, whole servers per node, CPU placement, dry runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal.config import ConfigError, load_config
from areal.launcher.plan import make_plan, plan_sections

REPO = Path(__file__).resolve().parents[2]


def nodes(n: int) -> list[str]:
    return [f"node{i}" for i in range(n)]


def test_math_1_5b_on_16_nodes_is_the_papers_split() -> None:
    cfg = load_config(str(REPO / "configs/math_1.5b.yaml"))
    plan = make_plan(
        nodes(16), 8, {f"node{i}": f"10.0.0.{i}" for i in range(16)}, **plan_sections(cfg)
    )
    assert (plan.inference_gpus, plan.training_gpus) == (96, 32)
    assert plan.n_servers == 96 == cfg.rollout.n_servers
    trainers = [s for s in plan.steps if s.role == "trainer"]
    assert plan.world_size == len(trainers) == 32
    # Inference fills the first 12 nodes, training the last 4: no node does both.
    assert {s.node for s in plan.steps if s.role == "server"} == set(nodes(12))
    assert {s.node for s in trainers} == set(nodes(16)[12:])
    assert all(s.gpus == 1 for s in plan.steps if s.role in ("server", "trainer"))
    assert sum(s.gpus for s in plan.steps) == 128
    assert [s.env["RANK"] for s in trainers] == [str(r) for r in range(32)]
    assert {s.env["WORLD_SIZE"] for s in trainers} == {"32"}
    assert {s.env["MASTER_ADDR"] for s in trainers} == {"10.0.0.12"}  # the first training node
    # Every rollout worker sits on its server's node.
    servers = {s.index: s.node for s in plan.steps if s.role == "server"}
    assert all(servers[s.index] == s.node for s in plan.steps if s.role == "rollout")
    assert [s.name for s in plan.steps if s.role in ("controller", "reward")] == [
        "reward0",
        "controller0",
    ]


def test_paper_configs_load_and_plan() -> None:
    for name, eta, gpus in [("math_7b", 8, 192), ("math_32b", 8, 384), ("code_14b", 4, 256)]:
        cfg = load_config(str(REPO / f"configs/{name}.yaml"))
        assert cfg.max_staleness == eta
        assert (cfg.trainer.batch_size, cfg.rollout.group_size) == (512, 16)
        assert cfg.trainer.lr == 2e-5 and cfg.rollout.max_new_tokens == 27648
        plan = make_plan(
            nodes(cfg.launcher.nodes), cfg.launcher.gpus_per_node, **plan_sections(cfg)
        )
        assert plan.inference_gpus + plan.training_gpus == gpus
        assert plan.inference_gpus == gpus * 3 // 4
        assert plan.n_servers == cfg.rollout.n_servers


def test_tensor_parallel_servers_never_span_nodes() -> None:
    cfg = load_config(None, ["inference.tp_size=4", "launcher.inference_fraction=0.5"])
    plan = make_plan(nodes(3), 4, **plan_sections(cfg))
    # 6 of 12 GPUs rounds down to one whole 4-GPU server; the other 8 GPUs train.
    assert (plan.n_servers, plan.inference_gpus, plan.training_gpus) == (1, 4, 8)
    with pytest.raises(ConfigError, match="does not divide"):
        make_plan(nodes(2), 8, **plan_sections(load_config(None, ["inference.tp_size=3"])))


def test_cpu_plan_splits_nodes() -> None:
    cfg = load_config(None, ["rollout.n_servers=3"])
    plan = make_plan(nodes(4), 0, **plan_sections(cfg))
    assert [s.node for s in plan.steps if s.role == "server"] == ["node0", "node1", "node2"]
    assert [s.node for s in plan.steps if s.role == "trainer"] == ["node3"]
    two = make_plan(
        nodes(2), 0, **plan_sections(cfg)
    )  # round(1.5) inference nodes, but one must train
    assert {s.node for s in two.steps if s.role == "trainer"} == {"node1"}
    one = make_plan(nodes(1), 0, **plan_sections(cfg))
    assert {s.node for s in one.steps} == {"node0"} and one.world_size == 1


def test_fraction_is_validated() -> None:
    with pytest.raises(ConfigError, match="launcher.inference_fraction must be in"):
        load_config(None, ["launcher.inference_fraction=1"])


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}  # no SLURM_JOB_ID: outside a job
    return subprocess.run(
        [sys.executable, "-m", "areal.train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_dry_run_prints_the_plan_and_outside_a_job_slurm_says_use_sbatch(tmp_path) -> None:
    proc = _train("--config", "configs/math_1.5b.yaml", "--dry-run", f"fileroot={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert "96 GPUs for inference (96 servers), 32 for training" in proc.stdout
    assert "node15: trainer24-31 [gpu 0-7, 1 each]" in proc.stdout
    assert not (tmp_path / "math_1.5b").exists()  # a dry run starts and writes nothing
    proc = _train("--config", "configs/tiny.yaml", "launcher.type=slurm", f"fileroot={tmp_path}")
    assert proc.returncode == 2 and "sbatch" in proc.stderr and "salloc" in proc.stderr
    proc = _train("launcher.type=slurm", "--dry-run", "--nodes", "2", "--gpus-per-node", "4")
    assert "6 GPUs for inference (6 servers), 2 for training (world size 2)" in proc.stdout


def test_local_launcher_gives_each_gpu_step_its_own_gpus_and_cpu_roles_none() -> None:
    from areal.launcher.local import LocalLauncher

    cfg = load_config(str(REPO / "configs/math_1.5b.yaml"), ["launcher.type=local"])
    cfg.launcher.gpus_per_node = 8
    launcher = LocalLauncher(cfg)
    seen = {s.name: launcher.command(s, [])[1]["CUDA_VISIBLE_DEVICES"] for s in launcher.plan.steps}
    gpu_steps = [v for v in seen.values() if v]
    assert sorted(gpu_steps) == [str(i) for i in range(8)]  # each GPU held by one step
    assert seen["controller0"] == seen["rollout0"] == seen["reward0"] == ""


def test_cpu_servers_and_trainer_ranks_split_their_nodes_cores(monkeypatch) -> None:
    from areal.cores import (
        CPU_GRADING_ENV,
        CPU_LEDGER_ENV,
        CPU_SHARE_ENV,
        CPU_SLOT_ENV,
        role_threads,
    )

    cfg = load_config(
        str(REPO / "configs/tiny.yaml"),
        ["rollout.n_servers=2", "trainer.parallel.dp=2", "launcher.lend_idle_cores=true"],
    )
    plan = make_plan(nodes(1), 0, **plan_sections(cfg))
    computing_roles = ("server", "trainer")
    computing = [s for s in plan.steps if s.role in computing_roles]
    assert len(computing) == 4 and {s.env[CPU_SHARE_ENV] for s in computing} == {"4"}
    assert all(CPU_SHARE_ENV not in s.env for s in plan.steps if s not in computing)
    # Each computing step has its own slot in the node's ledger, through which it lends its
    # cores while it waits (areal/cores.py); the reward service's grading says in the slot
    # after theirs what its pool uses; the other steps compute nothing.
    assert sorted(int(s.env[CPU_SLOT_ENV]) for s in computing) == [0, 1, 2, 3]
    reward = next(s for s in plan.steps if s.role == "reward")
    assert reward.env[CPU_GRADING_ENV] == "4"
    assert len({s.env[CPU_LEDGER_ENV] for s in [*computing, reward]}) == 1
    assert all(CPU_LEDGER_ENV not in s.env for s in plan.steps if s not in [*computing, reward])

    def sync_plan(*more: str):
        overrides = ["rollout.n_servers=2", "trainer.parallel.dp=2", "max_staleness=0", *more]
        return make_plan(
            nodes(1), 0, **plan_sections(load_config(str(REPO / "configs/tiny.yaml"), overrides))
        )

    # A fixed split (no lending): at eta=0 the servers idle while the trainer trains, so its
    # ranks split the cores between themselves; the servers keep their share.
    fixed = sync_plan("launcher.lend_idle_cores=false")
    shares = {(s.role, s.env.get(CPU_SHARE_ENV)) for s in fixed.steps if s.role in computing_roles}
    assert shares == {("server", "4"), ("trainer", "2")}
    assert all(CPU_LEDGER_ENV not in s.env for s in fixed.steps)
    # vLLM's threads are its own: beside it the split stays fixed.
    lend = "launcher.lend_idle_cores=true"
    vllm = sync_plan("inference.backend=vllm", "model.tiny_heads=2", lend)
    assert all(CPU_LEDGER_ENV not in s.env for s in vllm.steps)
    # With GPUs a step computes on its own GPU: no share of the CPUs.
    gpu_cfg = load_config(str(REPO / "configs/math_1.5b.yaml"))
    assert all(
        CPU_SHARE_ENV not in s.env for s in make_plan(nodes(16), 8, **plan_sections(gpu_cfg)).steps
    )

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv(CPU_SHARE_ENV, "4")
    assert role_threads(0) == max(1, cores // 4)
    assert role_threads(3) == 3  # configured: taken as it is
    monkeypatch.delenv(CPU_SHARE_ENV)
    assert role_threads(0) == cores


def test_one_gpu_is_shared_by_the_server_and_the_trainer() -> None:
    from areal.launcher.local import LocalLauncher
    from areal.launcher.slurm import Allocation, SlurmLauncher

    cfg = load_config(None, ["launcher.type=local", "launcher.gpus_per_node=1"])
    launcher = LocalLauncher(cfg)
    plan = launcher.plan
    assert (plan.n_servers, plan.world_size) == (1, 1)
    line = ": server0 [gpu 0], reward0, rollout0, controller0, trainer0 [gpu 0, shared with "
    assert line in plan.describe()
    env = {s.name: launcher.command(s, [])[1]["CUDA_VISIBLE_DEVICES"] for s in plan.steps}
    assert env["server0"] == env["trainer0"] == "0"
    # Under SLURM the trainer's step overlaps the server's instead of waiting for its GPU.
    alloc = Allocation("1", ["n0"], {"n0": "n0"}, gpus_per_node=1, cpus_per_node=4)
    slurm = SlurmLauncher(cfg, alloc, make_plan(["n0"], 1, **plan_sections(cfg)))
    srun = {s.name: slurm.command(s, ["x"])[0] for s in slurm.plan.steps}
    assert "--exact" in srun["server0"] and "--gpus-per-node=1" in srun["server0"]
    assert "--overlap" in srun["trainer0"] and "--gpus-per-node=1" in srun["trainer0"]
    # Two GPUs: each holds its own again.
    two = make_plan(["n0"], 2, **plan_sections(cfg))
    assert not any(s.colocated for s in two.steps) and two.training_gpus == 1
