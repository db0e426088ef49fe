"""The SLURM launcher: inside an allocation, every step of the plan as an `srun` job step.

    sbatch scripts/run_math.sh -> python -m areal.train launcher.type=slurm (batch node)
        --srun -w n0 --exact --gpus-per-node=1--> server{k}   (GPU steps hold their GPUs)
        --srun -w n0 --overlap --gpus-per-node=0--> rollout{k}, reward0, controller0
        --srun -w n12 --exact --gpus-per-node=1--> trainer{rank} (RANK, WORLD_SIZE, MASTER_*)
        <-- each srun's exit code = its step's; logs/{step}.log on the shared file system

Nodes come from SLURM_JOB_NODELIST, their addresses (NodeAddr) from scontrol; each step
gets AREAL_HOST = its node's address, so it binds all interfaces and registers an address
the other nodes reach. A dead step stops every other (SIGTERM to the sruns, which forward
it), and the launcher exits 1 so the job ends FAILED; SLURM itself kills whatever is left
when the batch script ends, and on scancel every step is signalled by slurmd directly.

A step SLURM cannot create (its node's CPUs or GPUs are held by other steps, or the
allocation lacks them) fails within STEP_START_S (srun --immediate) instead of waiting
forever, and the run stops at once naming the step, its node and what it asked for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from areal.comm.net import HOST_ENV
from areal.config import ConfigError, ExperimentConfig
from areal.launcher.base import Launcher, Proc
from areal.launcher.plan import Plan, Step, make_plan, plan_sections


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: list[str]
    addresses: dict[str, str]
    gpus_per_node: int
    cpus_per_node: int


def in_allocation() -> bool:
    return "SLURM_JOB_ID" in os.environ and "SLURM_JOB_NODELIST" in os.environ


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(
            ["scontrol", *args], check=True, capture_output=True, text=True, timeout=60
        ).stdout
    except FileNotFoundError:
        raise ConfigError("scontrol not found: launcher.type=slurm needs SLURM's tools") from None
    except subprocess.CalledProcessError as e:
        raise ConfigError(f"scontrol {' '.join(args)} failed: {e.stderr.strip()}") from None


def _node_addresses(nodelist: str) -> dict[str, str]:
    """node name -> NodeAddr (what other nodes connect to; the name itself if unset)."""
    addresses = {}
    for line in _scontrol("-o", "show", "node", nodelist).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            addresses[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return addresses


def _int_env(name: str) -> int:
    # SLURM writes e.g. SLURM_CPUS_ON_NODE=8 and, for GPUs, a plain count.
    try:
        return int(os.environ.get(name, "0").split("(")[0])
    except ValueError:
        return 0


def current_allocation() -> Allocation:
    if not in_allocation():
        raise ConfigError(
            "launcher.type=slurm runs inside a SLURM allocation: submit with "
            "`sbatch scripts/run_math.sh [--config FILE] [key=value ...]` or start it within "
            "`salloc`; to only see the placement, add --dry-run --nodes N --gpus-per-node G"
        )
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    nodes = _scontrol("show", "hostnames", nodelist).split()
    return Allocation(
        job_id=os.environ["SLURM_JOB_ID"],
        nodes=nodes,
        addresses=_node_addresses(nodelist),
        gpus_per_node=_int_env("SLURM_GPUS_ON_NODE"),
        cpus_per_node=_int_env("SLURM_CPUS_ON_NODE"),
    )


def plan_in_allocation(cfg: ExperimentConfig, alloc: Allocation) -> Plan:
    """The plan for `cfg` on the allocation, using launcher.nodes/gpus_per_node if set."""
    lc = cfg.launcher
    n = lc.nodes if lc.nodes is not None else len(alloc.nodes)
    if n > len(alloc.nodes):
        raise ConfigError(
            f"launcher.nodes={n} but the allocation has {len(alloc.nodes)} nodes: "
            f"submit with sbatch -N {n}, or set launcher.nodes=null to use the allocation"
        )
    if n < len(alloc.nodes):
        print(
            f"areal: warning: using {n} of the allocation's {len(alloc.nodes)} nodes "
            f"(launcher.nodes={n})",
            file=sys.stderr,
        )
    gpus = lc.gpus_per_node if lc.gpus_per_node is not None else alloc.gpus_per_node
    if gpus > alloc.gpus_per_node:
        raise ConfigError(
            f"launcher.gpus_per_node={gpus} but the allocation gives {alloc.gpus_per_node} GPUs "
            f"per node: submit with --gpus-per-node={gpus}, or set launcher.gpus_per_node=null"
        )
    # A port per job, so that two jobs sharing a node do not rendezvous on the same one.
    master_port = 20000 + int(alloc.job_id) % 20000
    return make_plan(alloc.nodes[:n], gpus, alloc.addresses, master_port, **plan_sections(cfg))


STEP_START_S = 10
"""Seconds srun may wait for a step's resources (a just-stopped step may still hold them)."""
_NO_STEP = "Unable to create step"  # srun's words when it gives up creating a step


class SlurmLauncher(Launcher):
    def __init__(self, cfg: ExperimentConfig, alloc: Allocation, plan: Plan):
        super().__init__(cfg, plan)
        self.alloc = alloc

    def exit_reason(self, p: Proc, rc: int) -> str:
        # srun reports a task killed by signal N as exit code 128 + N.
        try:
            name = signal.Signals(rc - 128).name if rc > 128 else None
        except ValueError:  # not a signal number: a plain exit code
            name = None
        if name:
            return f"was killed by {name} (srun exit code {rc})"
        return super().exit_reason(p, rc)

    def start_failure(self, p: Proc) -> str | None:
        try:
            lines = p.log.read_text(errors="replace").splitlines()[:50]
        except OSError:
            return None
        errors = [ln.strip() for ln in lines if ln.startswith("srun: error")]
        if not any(_NO_STEP in ln for ln in errors):
            return None
        step = p.step
        asked = f"{step.gpus} GPU(s), {self._cpus(step)} CPU(s)" if step.gpus else "shared CPUs"
        return (
            f"SLURM could not create step {step.name} on node {step.node} (it asks for "
            f"{asked}, the allocation has {self.alloc.gpus_per_node} GPU(s) and "
            f"{self.alloc.cpus_per_node} CPU(s) per node): "
            + " ".join(errors)
            + ". Free those resources, or ask the allocation for more"
        )

    def _cpus(self, step: Step) -> int:
        return max(1, self.alloc.cpus_per_node // self.plan.gpus_per_node * step.gpus)

    def command(self, step: Step, cmd: list[str]) -> tuple[list[str], dict[str, str]]:
        srun = [
            "srun",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={step.node}",
            f"--job-name={step.name}",
            "--export=ALL",  # the launcher's environment (venv, PYTHONPATH) plus the step's
            "--kill-on-bad-exit=1",
            f"--immediate={STEP_START_S}",
        ]
        if step.colocated:
            # A trainer on the server's GPU (plan.py): it shares the server's resources.
            srun += ["--overlap", f"--gpus-per-node={step.gpus}"]
        elif step.gpus:
            # The step holds its GPUs (and a fair share of CPUs) alone: no other step gets them.
            cpus = self._cpus(step)
            srun += ["--exact", f"--gpus-per-node={step.gpus}", f"--cpus-per-task={cpus}"]
        else:
            # CPU roles share the node with the GPU steps (and, in CPU runs, with each other).
            srun += ["--overlap"]
            if self.alloc.gpus_per_node:
                srun += ["--gpus-per-node=0"]  # else the step would see every GPU of the job
        srun += self.cfg.launcher.srun_args
        return [*srun, *cmd], {HOST_ENV: self.alloc.addresses.get(step.node, step.node)}
