"""The Ray launcher's pure parts (no Ray needed): which nodes a plan goes to, and its bundles."""

from __future__ import annotations

from pathlib import Path

from areal.config import load_config
from areal.launcher.plan import make_plan, plan_sections
from areal.launcher.ray_plan import (
    NODE_LABEL,
    TOKEN_CPU,
    RayNode,
    choose_nodes,
    eligible,
    forwarded_env,
    placement,
)

ROOT = Path(__file__).resolve().parents[2]


def node(i: int, gpus: int = 8, cpus: float = 96) -> RayNode:
    return RayNode(f"{i:02d}" + "ab" * 27, f"10.0.0.{i}", cpus, gpus)


def test_nodes_without_the_gpus_or_without_cpus_hold_nothing():
    head = node(0, gpus=0, cpus=0)  # KubeRay's head with num-cpus 0
    small = node(1, gpus=4)
    assert eligible([head, small, node(2)], 8) == [node(2)]
    assert eligible([head, small, node(2)], 0) == [small, node(2)]


def test_the_drivers_node_comes_first_then_by_address():
    nodes = [node(3), node(1), node(2)]
    chosen = choose_nodes(nodes, 2, [], driver=node(2).node_id)
    assert chosen == [node(2), node(1)]
    assert choose_nodes(nodes, 4, [], driver=None) is None


def test_a_lost_node_is_replaced_in_its_place_and_the_others_stay():
    previous = [node(1), node(2), node(3)]
    alive = [node(1), node(3), node(4), node(5)]  # node 2 was lost
    assert choose_nodes(alive, 3, previous, driver=node(1).node_id) == [node(1), node(4), node(3)]
    assert choose_nodes([node(1), node(3)], 3, previous, driver=None) is None


def test_bundles_of_the_15b_plan_hold_gpus_and_a_fair_share_of_cpus():
    cfg = load_config(ROOT / "configs/math_1.5b.yaml", ["launcher.type=ray"])
    nodes = [node(i) for i in range(16)]
    plan = make_plan(
        [n.name for n in nodes], 8, {n.name: n.ip for n in nodes}, 0, **plan_sections(cfg)
    )
    pl = placement(plan, {n.name: n.node_id for n in nodes}, cpus_per_node=96)
    assert len(pl.bundles) == len(plan.steps)
    gpu = [b for b in pl.bundles if "GPU" in b]
    assert len(gpu) == 96 + 32  # 96 servers of 1 GPU, 32 trainer ranks
    assert all(b == {"GPU": 1.0, "CPU": 11.0} for b in gpu)  # (96 - 1) // 8 CPUs per GPU
    assert [b for b in pl.bundles if "GPU" not in b] == [{"CPU": TOKEN_CPU}] * (96 + 2)
    # Each bundle is pinned to the node its step was planned on.
    ids = {n.name: n.node_id for n in nodes}
    for step in plan.steps:
        assert pl.selectors[pl.bundle_of[step.name]] == {NODE_LABEL: ids[step.node]}
    assert pl.describe().startswith(
        "placement group: 226 bundles (128 x {GPU: 1, CPU: 11}, 98 x {CPU: 0.01})"
    )


def test_a_trainer_sharing_the_servers_gpu_shares_its_bundle():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["launcher.type=ray"])
    plan = make_plan(["n0"], 1, **plan_sections(cfg))
    pl = placement(plan, {"n0": "id0"}, cpus_per_node=8)
    trainer = next(s for s in plan.steps if s.role == "trainer")
    assert trainer.colocated
    assert pl.bundle_of["trainer0"] == pl.bundle_of["server0"]
    assert pl.actor_resources(trainer) == {}
    assert len(pl.bundles) == len(plan.steps) - 1


def test_cpu_roles_and_cpu_plans_take_a_token_cpu():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["launcher.type=ray"])
    plan = make_plan(["n0", "n1"], 0, **plan_sections(cfg))
    pl = placement(plan, {"n0": "a", "n1": "b"}, cpus_per_node=2)
    assert pl.bundles == [{"CPU": TOKEN_CPU}] * len(plan.steps)


def test_only_the_drivers_areal_and_library_settings_reach_the_steps():
    env = {"AREAL_X": "1", "HF_HOME": "/h", "NCCL_DEBUG": "INFO", "AREAL_HOST": "a", "PATH": "/b"}
    assert forwarded_env(env) == {"AREAL_X": "1", "HF_HOME": "/h", "NCCL_DEBUG": "INFO"}
