"""The local launcher: every role as a subprocess of this one, on this machine.

    launcher --Popen--> server{k} (registers its URL, becomes the inference server)
             --Popen--> reward0, rollout{k}, controller0              logs/{role}{k}.log
             --Popen--> trainer{r}, r < trainer.parallel.dp          (RANK, WORLD_SIZE, ...)

The plan is the single-node placement (areal/launcher/plan.py): CPU-only by default, or
over launcher.gpus_per_node GPUs of this machine, each GPU step seeing only its own GPUs
(CUDA_VISIBLE_DEVICES) and the CPU roles none; the poll/stop/report loop is
launcher/base.py's. Each child gets SIGKILL if the launcher itself dies
(PR_SET_PDEATHSIG), so a run never leaves orphans.
"""

from __future__ import annotations

import os
import socket

from areal.comm.net import free_port
from areal.config import ExperimentConfig
from areal.launcher.base import Launcher
from areal.launcher.plan import Plan, Step, make_plan, plan_sections


def local_plan(gpus_per_node: int, **sections) -> Plan:
    """The plan on this host (make_plan's sections: plan.plan_sections)."""
    host = socket.gethostname()
    return make_plan([host], gpus_per_node, {host: "127.0.0.1"}, free_port(), **sections)


class LocalLauncher(Launcher):
    def __init__(self, cfg: ExperimentConfig):
        super().__init__(cfg, local_plan(cfg.launcher.gpus_per_node or 0, **plan_sections(cfg)))

    def command(self, step: Step, cmd: list[str]) -> tuple[list[str], dict[str, str]]:
        env = {}
        if self.plan.gpus_per_node:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in step.gpu_ids)
        if step.role == "trainer" and self.plan.world_size > 1:
            # gloo picks the interface of the hostname, which need not reach 127.0.0.1.
            env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        return cmd, env
