"""Placement: which node runs which role on which GPUs. Pure: no SLURM, no processes.

    nodes:  n0 ......... n11 | n12 ......... n15        (16 nodes x 8 GPUs, the paper's 1.5B run)
    GPUs:   inference: 96    | training: 32             (launcher.inference_fraction = 0.75)
    steps:  server{k} (inference.tp_size GPUs) + rollout{k} beside it   trainer{rank} (1 GPU)
            controller0, reward0 on the first node, sharing its CPUs

With GPUs the split is by GPU, in node order, rounded down to whole servers, so that a
server never spans two nodes and every node left over trains. Without GPUs (CPU tests) the
split is by node: rollout.n_servers servers spread over the inference nodes and
tp * pp * dp trainer ranks (trainer.parallel) over the training nodes; a single node runs
everything. With GPUs every training GPU is a rank, and dp = training GPUs / (tp * pp).
With exactly one server's GPUs in all (one GPU, inference.tp_size=1: a laptop or a
workstation), the trainer ranks share those GPUs with the server (Step.colocated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from areal.config import (
    ConfigError,
    ExperimentConfig,
    InferenceConfig,
    LauncherConfig,
    ParallelConfig,
)
from areal.cores import CPU_GRADING_ENV, CPU_LEDGER_ENV, CPU_SHARE_ENV, CPU_SLOT_ENV, ledger_path
from areal.rollout.backends import load_backend


@dataclass(frozen=True)
class Step:
    """One process of the run: `python -m areal.worker --role ROLE --index INDEX` on NODE."""

    role: str
    index: int
    node: str
    gpus: int = 0
    """GPUs the step holds alone; 0 = it shares the node's CPUs with the others."""
    gpu_ids: tuple[int, ...] = ()
    """Which of the node's GPUs those are (0-based): CUDA_VISIBLE_DEVICES for a launcher
    that does not bind GPUs itself (srun does, so the SLURM launcher ignores this)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of the step beyond the launcher's (torch.distributed rendezvous)."""
    colocated: bool = False
    """The step's GPUs are also the server's: it shares them instead of holding them alone."""

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"


@dataclass(frozen=True)
class Plan:
    nodes: list[str]
    gpus_per_node: int
    inference_gpus: int
    training_gpus: int
    steps: list[Step]

    @property
    def n_servers(self) -> int:
        return sum(s.role == "server" for s in self.steps)

    @property
    def world_size(self) -> int:
        return sum(s.role == "trainer" for s in self.steps)

    def describe(self) -> str:
        """The plan, one line per node, for the dry run and the job's log."""
        if self.gpus_per_node:
            head = (
                f"{len(self.nodes)} nodes x {self.gpus_per_node} GPUs: "
                f"{self.inference_gpus} GPUs for inference ({self.n_servers} servers), "
                f"{self.training_gpus} for training (world size {self.world_size})"
            )
        else:
            head = (
                f"{len(self.nodes)} nodes, CPU only: {self.n_servers} inference servers, "
                f"{self.world_size} trainer ranks"
            )
        lines = [head]
        for node in self.nodes:
            groups: list[list[Step]] = []  # runs of consecutive steps of one role
            for s in (s for s in self.steps if s.node == node):
                if groups and groups[-1][-1].role == s.role and groups[-1][-1].gpus == s.gpus:
                    groups[-1].append(s)
                else:
                    groups.append([s])
            parts = []
            for g in groups:
                first, last = g[0], g[-1]
                name = first.name if len(g) == 1 else f"{first.name}-{last.index}"
                if first.gpus:
                    lo, hi = first.gpu_ids[0], last.gpu_ids[-1]
                    each = f", {first.gpus} each" if len(g) > 1 else ""
                    shared = ", shared with the server" if first.colocated else ""
                    name += f" [gpu {lo}" + (f"-{hi}" if hi > lo else "") + f"{each}{shared}]"
                parts.append(name)
            lines.append(f"  {node}: {', '.join(parts) or '(idle)'}")
        return "\n".join(lines)


def make_plan(
    nodes: list[str],
    gpus_per_node: int,
    addresses: dict[str, str] | None = None,
    master_port: int = 29500,
    *,
    launcher: LauncherConfig,
    inference: InferenceConfig,
    n_servers: int,
    parallel: ParallelConfig,
    exp_dir: Path,
    max_staleness: int,
) -> Plan:
    """Place every role of the run on `nodes` (n_servers inference servers of
    inference.tp_size GPUs, the trainer ranks of trainer.parallel); addresses maps node ->
    reachable address. The launchers pass a config's sections: plan_sections(cfg)."""
    if not nodes:
        raise ConfigError("no nodes to place the run on: launcher.nodes must be >= 1")
    addresses = addresses or {}
    if gpus_per_node:
        servers, trainers, n_inf, n_train = _gpu_split(
            inference.tp_size, launcher.inference_fraction, parallel, nodes, gpus_per_node
        )
    else:
        servers, trainers = _cpu_split(
            launcher.inference_fraction, n_servers, parallel.world_size, nodes
        )
        n_inf = n_train = 0
    # CPU servers and trainer ranks split their node's cores (a GPU step computes on its GPU).
    sharing = [node for node, gpus, _ in (*servers, *trainers) if not gpus]
    training = [node for node, gpus, _ in trainers if not gpus]
    # A waiting role lends its share to those with work (areal/cores.py). A server whose
    # threads are its own (vLLM's) cannot, so beside it the split stays fixed.
    lend = launcher.lend_idle_cores and load_backend(inference.backend).lends_cores
    slots: dict[str, int] = {}

    def share(node: str, gpus: int, among: list[str]) -> dict[str, str]:
        if gpus:
            return {}
        env = {CPU_SHARE_ENV: str(among.count(node))}
        if lend:
            env[CPU_LEDGER_ENV] = ledger_path(exp_dir)
            env[CPU_SLOT_ENV] = str(slots.setdefault(node, 0))
            slots[node] += 1
        return env

    steps: list[Step] = []
    for k, (node, gpus, first) in enumerate(servers):
        steps.append(Step("server", k, node, gpus, _ids(gpus, first), share(node, gpus, sharing)))
    # Service roles share the first node's CPUs; each rollout worker sits beside its server.
    # Beside lending roles, the reward service says in the ledger what its grading uses.
    grading = {}
    if lend and nodes[0] in sharing:
        grading = {CPU_LEDGER_ENV: ledger_path(exp_dir)}
        grading[CPU_GRADING_ENV] = str(sharing.count(nodes[0]))
    steps.append(Step("reward", 0, nodes[0], env=grading))
    for k, (node, *_) in enumerate(servers):
        steps.append(Step("rollout", k, node))
    steps.append(Step("controller", 0, nodes[0]))
    master = addresses.get(trainers[0][0], trainers[0][0])
    colocated = n_inf + n_train > len(nodes) * gpus_per_node  # GPUs counted twice: shared
    for rank, (node, gpus, first) in enumerate(trainers):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(trainers)),
            # A GPU rank is its own step holding its own GPU, so it sees that GPU as cuda:0.
            "LOCAL_RANK": str(sum(n == node for n, *_ in trainers[:rank]) if not gpus else 0),
            "MASTER_ADDR": master,
            "MASTER_PORT": str(master_port),
            # Without lending, at max_staleness=0 the servers wait for every version while the
            # trainer trains, so its ranks split the cores among themselves alone.
            **share(node, gpus, training if max_staleness == 0 and not lend else sharing),
        }
        steps.append(Step("trainer", rank, node, gpus, _ids(gpus, first), env, colocated))
    return Plan(nodes, gpus_per_node, n_inf, n_train, steps)


def _ids(gpus: int, first: int) -> tuple[int, ...]:
    return tuple(range(first, first + gpus))


def _gpu_split(
    tp: int,
    inference_fraction: float,
    parallel: ParallelConfig,
    nodes: list[str],
    gpus_per_node: int,
):
    if gpus_per_node % tp:
        raise ConfigError(
            f"inference.tp_size={tp} does not divide the {gpus_per_node} GPUs of a node: "
            "a server may not span nodes; pick a divisor of launcher.gpus_per_node"
        )
    total = len(nodes) * gpus_per_node
    if total == tp:
        # One server's GPUs and nothing else: its GPUs train too, one trainer rank each.
        _check_replicas(parallel, tp)
        return [(nodes[0], tp, 0)], [(nodes[0], 1, g) for g in range(tp)], tp, tp
    # Round to whole servers, keeping at least one server and one training GPU.
    n_inf = round(total * inference_fraction) // tp * tp
    n_inf = min(max(n_inf, tp), (total - 1) // tp * tp)
    if n_inf < tp:
        raise ConfigError(
            f"{total} GPUs cannot hold an inference server of inference.tp_size={tp} GPUs "
            "and a trainer: allocate more GPUs or lower inference.tp_size"
        )
    slots = [(node, g) for node in nodes for g in range(gpus_per_node)]
    # (node, GPUs, first GPU index on the node) of each server and each trainer rank.
    servers = [(node, tp, g) for node, g in slots[:n_inf] if g % tp == 0]
    trainers = [(node, 1, g) for node, g in slots[n_inf:]]
    _check_replicas(parallel, len(trainers))
    return servers, trainers, n_inf, total - n_inf


def _check_replicas(par: ParallelConfig, training_gpus: int) -> None:
    if training_gpus % (par.tp * par.pp):
        raise ConfigError(
            f"{training_gpus} training GPUs cannot hold replicas of trainer.parallel.tp * pp = "
            f"{par.tp * par.pp} GPUs: change tp/pp, launcher.inference_fraction or the nodes"
        )


def _cpu_split(inference_fraction: float, servers: int, ranks: int, nodes: list[str]):
    if len(nodes) == 1:
        inf_nodes = train_nodes = nodes
    else:
        n = min(max(round(len(nodes) * inference_fraction), 1), len(nodes) - 1)
        inf_nodes, train_nodes = nodes[:n], nodes[n:]
    inference = [(inf_nodes[k % len(inf_nodes)], 0, 0) for k in range(servers)]
    # tp * pp * dp trainer ranks, spread over the training nodes in turn.
    return inference, [(train_nodes[r % len(train_nodes)], 0, 0) for r in range(ranks)]


def plan_sections(cfg: ExperimentConfig) -> dict:
    """make_plan's keyword arguments from a config: the sections placement reads."""
    return dict(
        launcher=cfg.launcher,
        inference=cfg.inference,
        n_servers=cfg.rollout.n_servers,
        parallel=cfg.trainer.parallel,
        exp_dir=cfg.exp_dir,
        max_staleness=cfg.max_staleness,
    )
