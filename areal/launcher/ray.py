"""The Ray launcher: the plan SLURM uses (plan.py) placed on a running Ray cluster, every step
a Ray actor that runs the step's `python -m areal.worker` as its child (ray_role.py).

    python -m areal.train launcher.type=ray       (the driver: on a node of the cluster, or
      |                                             the entrypoint of `ray job submit`)
      | 1) nodes: the alive nodes with launcher.gpus_per_node GPUs, the driver's own first
      | 2) plan.py's placement on them; one placement group, a bundle per step pinned to its
      |    node by the ray.io/node-id label: {GPU: g, CPU: c} for a server or a trainer rank,
      |    a token {CPU: 0.01} for a role that shares the node's cores (srun --overlap's part)
      '--RoleActor in each bundle --Popen--> python -m areal.worker --role R --index k
           CUDA_VISIBLE_DEVICES = the GPUs Ray gave the bundle; AREAL_HOST = the node's IP;
           MASTER_ADDR/PORT = trainer0's node and a port free there (asked of its actor)
         <-- run() returns the step's exit code; logs/{step}.log on shared storage

What this launcher adds to base.py's loop: a step whose actor dies (its node is lost: the
raylet stopped, the pod was evicted) is a dead role "lost with its node", recovered like any
other; the next attempt places the plan again on alive nodes, in the lost node's place a
spare one or its replacement (KubeRay, the autoscaler), waited for up to
launcher.ray_node_wait_s. An attempt whose nodes all live reuses the placement group and the
actors. Ctrl-C and SIGTERM (`ray job stop`) stop every step, then kill the actors and remove
the group; a driver that dies outright takes them along (Ray kills the actors a driver owns,
and each actor's child dies with it).

The roles find each other through the registry in the experiment directory, so
`fileroot` must be storage every node mounts at the same path (NFS, a PVC with
ReadWriteMany), as under SLURM.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from areal.comm.net import HOST_ENV
from areal.config import ConfigError, ExperimentConfig
from areal.launcher.base import Launcher, Proc
from areal.launcher.plan import Plan, Step, make_plan, plan_sections
from areal.launcher.ray_plan import (
    Placement,
    RayNode,
    choose_nodes,
    eligible,
    forwarded_env,
    placement,
)

SUSPECT_S = 60.0
"""A node that lost an actor but is still alive after this long is trusted again (Ray's
health check marks a node whose raylet stopped dead well within it)."""


class PlacementError(Exception):
    """The cluster cannot hold the plan (not enough nodes, resources held by others)."""


PROBE_S = 5.0
"""Seconds to wait for a TCP connection to the cluster's address before calling it gone
(ray.init itself retries an unreachable head for minutes)."""


def head_address(address: str) -> tuple[str, int] | None:
    """(host, port) that launcher.ray_address (or, for auto, $RAY_ADDRESS or the cluster
    that `ray start` on this node recorded) points at; None when there is nothing to probe."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "")
        if not address:
            recorded = Path("/tmp/ray/ray_current_cluster")
            address = recorded.read_text().strip() if recorded.is_file() else ""
    address = address.removeprefix("ray://")
    if not address or address in ("auto", "local") or ":" not in address:
        return None
    host, port = address.rsplit(":", 1)
    return (host, int(port)) if port.isdigit() else None


def reachable(address: str) -> str | None:
    """Why the cluster at `address` cannot be reached, if it cannot."""
    head = head_address(address)
    if head is None:
        return None
    try:
        socket.create_connection(head, timeout=PROBE_S).close()
    except OSError as e:
        return f"nothing answers at {head[0]}:{head[1]} within {PROBE_S:.0f} s ({e})"
    return None


def connect(address: str) -> None:
    """Join the cluster as a driver (once per process)."""
    import ray

    if ray.is_initialized():
        return
    if (why := reachable(address)) is not None:
        raise ConfigError(
            f"launcher.type=ray found no Ray cluster at launcher.ray_address={address!r}: "
            f"{why}. Start one (`ray start --head --port=PORT`; docs/get-started/ray.md: "
            "a Ray cluster on one machine), or set launcher.ray_address to its head's HOST:PORT"
        )
    try:
        ray.init(
            address=address,
            log_to_driver=False,  # each role's output is in its log, as under SLURM
            logging_level="WARNING",
            configure_logging=True,
        )
    except ConnectionError as e:
        raise ConfigError(
            f"launcher.type=ray found no Ray cluster at launcher.ray_address={address!r} "
            f"({e}): start one (`ray start --head`), run on one of its nodes or submit with "
            "`ray job submit`, or set launcher.ray_address=HEAD_HOST:6379"
        ) from None


def cluster_nodes() -> list[RayNode]:
    import ray

    return [
        RayNode(
            node_id=n["NodeID"],
            ip=n["NodeManagerAddress"],
            cpus=n["Resources"].get("CPU", 0.0),
            gpus=int(n["Resources"].get("GPU", 0)),
        )
        for n in ray.nodes()
        if n["Alive"]
    ]


def driver_node() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # a ray:// client has no node of its own
        return None


def wait_for_nodes(
    cfg: ExperimentConfig,
    gpus: int,
    previous: list[RayNode],
    suspects: dict[str, float],
    wait: bool,
) -> list[RayNode]:
    """The nodes of the next plan: launcher.nodes of them (or, first, every eligible node),
    waiting up to launcher.ray_node_wait_s for enough to be alive."""
    lc = cfg.launcher
    want = len(previous) or lc.nodes
    deadline = time.monotonic() + (lc.ray_node_wait_s if wait else 0)
    said = False
    while True:
        now = time.time()
        for node_id in [k for k, t in suspects.items() if now - t > SUSPECT_S]:
            del suspects[node_id]
        candidates = [n for n in eligible(cluster_nodes(), gpus) if n.node_id not in suspects]
        n = want or len(candidates)
        chosen = choose_nodes(candidates, n, previous, driver_node()) if n else None
        if chosen is not None:
            return chosen
        if time.monotonic() >= deadline:
            what = f"{gpus} GPUs and CPUs" if gpus else "CPUs"
            raise PlacementError(
                f"the Ray cluster has {len(candidates)} alive node(s) with {what}, the run "
                f"needs {n or 1} (launcher.nodes): add nodes, lower launcher.nodes, or wait "
                f"longer (launcher.ray_node_wait_s={lc.ray_node_wait_s:g})"
            )
        if not said:
            print(
                f"areal: waiting up to {lc.ray_node_wait_s:g} s for {n or 1} Ray node(s) with "
                f"{gpus} GPU(s) ({len(candidates)} now)",
                file=sys.stderr,
                flush=True,
            )
            said = True
        time.sleep(1.0)


def nodes_plan(cfg: ExperimentConfig, nodes: list[RayNode], gpus: int) -> Plan:
    # MASTER_PORT is asked of trainer rank 0's actor before the steps start (RayLauncher).
    names = [n.name for n in nodes]
    return make_plan(names, gpus, {n.name: n.ip for n in nodes}, 0, **plan_sections(cfg))


def plan_on_ray(cfg: ExperimentConfig) -> tuple[Plan, list[RayNode] | None]:
    """The plan of `cfg` on the cluster at launcher.ray_address, and its nodes. A dry run
    with launcher.nodes set plans for that many nodes of launcher.gpus_per_node GPUs when no
    cluster is reachable or the one reached is smaller (planning a cluster before making it)."""
    lc = cfg.launcher
    offline = lc.dry_run and lc.nodes is not None
    try:
        connect(lc.ray_address)
        gpus = lc.gpus_per_node
        if gpus is None:  # every GPU the nodes have; 0 on a CPU cluster
            gpus = max((n.gpus for n in cluster_nodes()), default=0)
        nodes = wait_for_nodes(cfg, gpus, [], {}, wait=not lc.dry_run)
    except (ConfigError, PlacementError) as e:
        if not offline:
            raise ConfigError(str(e)) from None
        print(f"areal: {e}\nareal: planning for {lc.nodes} nodes instead")
        names = [f"node{i}" for i in range(lc.nodes)]
        return make_plan(names, lc.gpus_per_node or 0, **plan_sections(cfg)), None
    return nodes_plan(cfg, nodes, gpus), nodes


def describe(plan: Plan, nodes: list[RayNode] | None) -> str:
    ids = {n.name: n.node_id for n in nodes or []}
    cpus = min((n.cpus for n in nodes), default=None) if nodes else None
    text = f"{plan.describe()}\n{placement(plan, ids, cpus).describe()}"
    if nodes is None and plan.gpus_per_node:
        text += "; on a cluster a GPU bundle also holds (node CPUs - 1) // GPUs CPUs per GPU"
    return text


def ray_reason(e: BaseException) -> str:
    """Why Ray says an actor died, in one line: its node was lost (the raylet stopped, the
    pod went away: "Socket closed", "node ... died"), Ray's memory monitor killed it
    ("running low on memory"), or someone killed it."""
    text = str(e)
    for line in text.splitlines():
        if "low on memory" in line or "OOM" in line:
            return f"{type(e).__name__}: killed by Ray's memory monitor: {line.strip()[:200]}"
    first = " ".join(text.split())[:300]
    return f"{type(e).__name__}: {first}"


class RayRole:
    """A step run by a RoleActor: the base loop's view of it (base.RoleProcess)."""

    def __init__(self, actor: object, ref: object, node: str):
        self.actor, self.ref, self.node = actor, ref, node
        self.rc: int | None = None
        self.lost: str | None = None
        self.failed: str | None = None

    def _collect(self) -> None:
        import ray

        try:
            self.rc = ray.get(self.ref)
        except ray.exceptions.RayTaskError as e:  # run() raised: the step could not start
            self.failed, self.rc = str(e.cause), 1
        except ray.exceptions.RayError as e:  # the actor died, and the step with it
            self.lost = f"its Ray actor on node {self.node} died ({ray_reason(e)})"
            self.rc = -9

    def poll(self) -> int | None:
        if self.rc is None:
            self.wait(0)
        return self.rc

    def signal(self, sig: int) -> None:
        if self.rc is None:
            self.actor.signal.remote(sig)  # type: ignore[attr-defined]

    def wait(self, timeout: float | None) -> bool:
        import ray

        if self.rc is None:
            # None: until it ends, but a node that stops answering cannot hold the launcher.
            ready, _ = ray.wait([self.ref], timeout=30.0 if timeout is None else timeout)
            if ready:
                self._collect()
        return self.rc is not None


class RayLauncher(Launcher):
    def __init__(self, cfg: ExperimentConfig, plan: Plan, nodes: list[RayNode]):
        super().__init__(cfg, plan)
        self.nodes = nodes
        self.pg: object | None = None
        self.placement: Placement | None = None
        self.actors: dict[str, object] = {}
        self.where: dict[str, dict] = {}
        """Step name -> what its actor found on its node: ip, GPU ids, interpreter."""
        self.suspects: dict[str, float] = {}
        """Node id -> when a step's actor there was lost (such a node is not planned on)."""
        self.master_port = 0

    # -- placing --

    def begin_attempt(self) -> None:
        lost = {p.step.node for p in self.procs if p.handle.lost}
        if self.pg is not None and not lost:
            self.master_port = self._free_port()  # same nodes, same actors: a fresh port
            return
        by_name = {n.name: n for n in self.nodes}
        for name in lost:
            self.suspects[by_name[name].node_id] = time.time()
        if self.pg is not None:  # a node was lost: place the plan again, without it
            self._teardown()
            gpus = self.plan.gpus_per_node
            self.nodes = wait_for_nodes(self.cfg, gpus, self.nodes, self.suspects, wait=True)
            self.plan = nodes_plan(self.cfg, self.nodes, gpus)
        self._place()
        print(
            f"areal: placed on the Ray cluster:\n{describe(self.plan, self.nodes)}",
            file=sys.stderr if self.recoveries else sys.stdout,
            flush=True,
        )

    def _place(self) -> None:
        import ray
        from ray.util import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from areal.launcher.ray_role import RoleActor

        lc = self.cfg.launcher
        ids = {n.name: n.node_id for n in self.nodes}
        self.placement = pl = placement(self.plan, ids, min(n.cpus for n in self.nodes))
        self.pg = pg = placement_group(
            pl.bundles,
            strategy="PACK",
            name=f"areal-{self.cfg.experiment_name}-{self.cfg.trial_name}",
            bundle_label_selector=pl.selectors,
        )
        ready, _ = ray.wait([pg.ready()], timeout=lc.ray_node_wait_s)
        if not ready:
            raise PlacementError(
                f"Ray could not place the plan within {lc.ray_node_wait_s:g} s "
                f"({pl.describe()}): other jobs may hold those resources; free them, add "
                "nodes, or ask for fewer GPUs (launcher.gpus_per_node, launcher.nodes)"
            )
        # The checkout that runs the driver, first on every actor's path (shared storage; with
        # `ray job submit --working-dir` Ray ships it instead).
        root = str(Path(__file__).resolve().parents[2])
        runtime_env = {"env_vars": {"PYTHONPATH": f"{root}:${{PYTHONPATH}}"}}
        remote = ray.remote(RoleActor)
        for step in self.plan.steps:
            res = pl.actor_resources(step)
            self.actors[step.name] = remote.options(
                num_cpus=res.get("CPU", 0),
                num_gpus=res.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=pl.bundle_of[step.name]
                ),
                runtime_env=runtime_env,
            ).remote()
        names = list(self.actors)
        try:
            infos = ray.get(
                [self.actors[n].where.remote(str(self.exp_dir)) for n in names],  # type: ignore[attr-defined]
                timeout=lc.ray_node_wait_s,
            )
        except ray.exceptions.RayError as e:  # an actor that cannot start (its runtime env)
            raise PlacementError(f"Ray could not start the steps' actors: {e}") from None
        self.where = dict(zip(names, infos, strict=True))
        blind = sorted({s.node for s in self.plan.steps if not self.where[s.name]["sees_exp_dir"]})
        if blind:
            raise PlacementError(
                f"node(s) {', '.join(blind)} do not see the experiment directory {self.exp_dir}: "
                "set fileroot to storage every node mounts at the same path (NFS, a "
                "ReadWriteMany volume); the roles find each other through its registry"
            )
        self.master_port = self._free_port()

    def _free_port(self) -> int:
        import ray

        return ray.get(self.actors["trainer0"].free_port.remote(), timeout=60)  # type: ignore[attr-defined]

    def _teardown(self) -> None:
        import ray
        from ray.util import remove_placement_group

        for actor in self.actors.values():
            try:
                ray.kill(actor)  # type: ignore[arg-type]
            except Exception:  # already gone with its node
                pass
        self.actors, self.where = {}, {}
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)  # type: ignore[arg-type]
            except Exception:
                pass
            self.pg = None

    # -- running --

    def gpu_ids(self, step: Step) -> list[str]:
        """The GPUs Ray gave the step's bundle (a colocated trainer: its share of the server's)."""
        if step.colocated:
            server = next(s for s in self.plan.steps if s.role == "server" and s.node == step.node)
            return [self.where[server.name]["gpu_ids"][i] for i in step.gpu_ids]
        return self.where[step.name]["gpu_ids"]

    def command(self, step: Step, cmd: list[str]) -> tuple[list[str], dict[str, str]]:
        where = self.where[step.name]
        env = {**forwarded_env(dict(os.environ)), HOST_ENV: where["ip"]}
        if self.plan.gpus_per_node:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_ids(step))
        if step.role == "trainer":
            env["MASTER_PORT"] = str(self.master_port)
        return [where["python"], *cmd[1:]], env

    def spawn(
        self, step: Step, cmd: list[str], env: dict[str, str], log: Path, append: bool
    ) -> RayRole:
        actor = self.actors[step.name]
        nice = os.getpriority(os.PRIO_PROCESS, 0)  # the roles run as nice as the launcher
        ref = actor.run.remote(cmd, env, str(log), append, nice)  # type: ignore[attr-defined]
        return RayRole(actor, ref, step.node)

    def start_failure(self, p: Proc) -> str | None:
        failed = getattr(p.handle, "failed", None)
        if failed:
            return f"Ray could not start step {p.name} on node {p.step.node}: {failed}"
        return None

    def run(self, resume=None) -> int:  # noqa: ANN001 (base.Launcher.run's)
        try:
            return super().run(resume)
        except PlacementError as e:
            print(f"\nareal: {e}; stopping the run", file=sys.stderr, flush=True)
            return 1
        finally:
            self._teardown()
