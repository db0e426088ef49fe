"""Where the plan goes on a Ray cluster, without Ray: which nodes (RayNode, choose_nodes) and
which bundles of one placement group (placement): a bundle per step, pinned to the plan's node
by its ray.io/node-id label. areal/launcher/ray.py does the I/O.

    alive nodes --eligible--> with launcher.gpus_per_node GPUs and some CPUs
                --choose_nodes--> launcher.nodes of them, the driver's first; on a recovery
                                  the previous ones in place, a lost one's place to a spare
    plan.py's steps --placement--> {GPU: g, CPU: c} per server / trainer rank,
                                   {CPU: 0.01} per role sharing its node's cores
"""

from __future__ import annotations

from dataclasses import dataclass

from areal.comm.net import HOST_ENV
from areal.launcher.plan import Plan, Step

TOKEN_CPU = 0.01
"""What the bundle of a step that shares its node's cores reserves, so Ray can place it."""
NODE_LABEL = "ray.io/node-id"
"""The label every Ray node carries (its id): what pins a bundle to the plan's node."""
FORWARDED_ENV = ("AREAL_", "HF_", "NCCL_", "GLOO_", "TORCH_", "WANDB_")
"""Prefixes of the driver's environment variables that reach every step; the rest of a
step's environment is its node's (what `ray start` had there)."""


@dataclass(frozen=True)
class RayNode:
    node_id: str
    ip: str
    cpus: float
    gpus: int

    @property
    def name(self) -> str:
        """The node in the plan (and in its printout): address and the start of its id."""
        return f"{self.ip}/{self.node_id[:8]}"


def eligible(nodes: list[RayNode], gpus_per_node: int) -> list[RayNode]:
    """Nodes that can hold a share of the plan: every GPU step needs gpus_per_node GPUs, and
    a node without CPUs (a KubeRay head with num-cpus 0) runs nothing."""
    return [n for n in nodes if n.gpus >= gpus_per_node and n.cpus > 0]


def choose_nodes(
    candidates: list[RayNode], n: int, previous: list[RayNode], driver: str | None
) -> list[RayNode] | None:
    """n nodes for the plan, or None if the candidates are too few. The previous attempt's
    nodes keep their places (a lost one's place goes to another); a first choice takes the
    driver's node first (the controller and the reward service run there, beside it), then
    the rest by address and id."""
    fresh = sorted(candidates, key=lambda x: (x.node_id != driver, x.ip, x.node_id))
    alive = {x.node_id for x in candidates}
    kept = {x.node_id for x in previous if x.node_id in alive}
    spare = [x for x in fresh if x.node_id not in kept]
    chosen = [x if x.node_id in alive else None for x in previous[:n]]
    chosen += [None] * (n - len(chosen))
    for i, x in enumerate(chosen):
        if x is None:
            if not spare:
                return None
            chosen[i] = spare.pop(0)
    return chosen  # type: ignore[return-value]


@dataclass(frozen=True)
class Placement:
    """The placement group of a plan: its bundles (each pinned to a node) and the bundle each
    step runs in."""

    bundles: list[dict[str, float]]
    selectors: list[dict[str, str]]
    bundle_of: dict[str, int]
    """Step name -> bundle index; a trainer sharing the server's GPU (Step.colocated) shares
    its bundle too."""

    def actor_resources(self, step: Step) -> dict[str, float]:
        """What the step's actor takes of its bundle (all of it; nothing if colocated)."""
        if step.colocated:
            return {}
        return self.bundles[self.bundle_of[step.name]]

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for b in self.bundles:
            key = ", ".join(f"{k}: {v:g}" for k, v in b.items())
            kinds[key] = kinds.get(key, 0) + 1
        parts = [f"{n} x {{{k}}}" for k, n in kinds.items()]
        return (
            f"placement group: {len(self.bundles)} bundles ({', '.join(parts)}), "
            f"each pinned to its node by the {NODE_LABEL} label"
        )


def placement(plan: Plan, node_ids: dict[str, str], cpus_per_node: float | None) -> Placement:
    """A bundle per step of `plan`: a GPU step holds its GPUs and a fair share of its node's
    CPUs (one CPU kept for the roles beside it); the others a token CPU. node_ids maps a plan
    node to its Ray node id; cpus_per_node None (no cluster) leaves GPU bundles without CPUs."""
    per_gpu = 0
    if plan.gpus_per_node and cpus_per_node is not None:
        per_gpu = max(0, int(cpus_per_node - 1) // plan.gpus_per_node)
    bundles: list[dict[str, float]] = []
    selectors: list[dict[str, str]] = []
    bundle_of: dict[str, int] = {}
    for step in plan.steps:
        if step.colocated:
            continue
        if step.gpus:
            b: dict[str, float] = {"GPU": float(step.gpus)}
            if per_gpu:
                b["CPU"] = float(per_gpu * step.gpus)
        else:
            b = {"CPU": TOKEN_CPU}
        bundle_of[step.name] = len(bundles)
        bundles.append(b)
        selectors.append({NODE_LABEL: node_ids.get(step.node, step.node)})
    for step in plan.steps:
        if step.colocated:  # the trainer ranks of a one-server run share the server's bundle
            server = next(s for s in plan.steps if s.role == "server" and s.node == step.node)
            bundle_of[step.name] = bundle_of[server.name]
    return Placement(bundles, selectors, bundle_of)


def forwarded_env(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV) and k != HOST_ENV}
