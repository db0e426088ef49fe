"""A discrete-event simulation of one run as areal runs it, on a profile's cost models.

    controller (sim_controller.py): StalenessGate + ReplayBuffer (areal/controller/, the
        very classes) admit a group whenever the gate has capacity; the router sends it to
        the server with the fewest groups in flight; a finished group waits for the
        trainer, oldest first
    server k (sim_servers.py): continuous batching in decode steps; requests join between
        steps (up to inference.max_batch_size rows); a weight update aborts every request,
        waits for the step in flight, loads, and the resubmitted requests are prefilled
        again (prompt + output so far) under the new version
    trainer (sim_trainer.py): get_batch(i) -> step overhead -> proximal pass (minibatches
        2..n) -> n minibatch updates (micro-batches by Algorithm 1) -> publish v(i+1) ->
        fan-out to every server (one version at a time) -> the gate moves to i+1
    cores (sim_cores.py; CPU profile): servers and the trainer split the node's cores; a
        role waiting BORROW_AFTER_S lends its share to those working (areal/cores.py's
        rule), and more threads than cores slow every working role in proportion

| event        | what it does                                                          |
|--------------|-----------------------------------------------------------------------|
| segment end  | a server's run of k equal decode steps ends: a request finished, or a |
|              | change (a join, a thread change, an update) cut it at a step boundary |
| arrive       | a group's requests reach its server (half the group overhead after    |
|              | admission), which spends decode.group_s on them outside its steps     |
| group done   | its last sample finished (+ half the overhead): the gate, the buffer  |
| load done    | a server holds the new version; the last one moves the gate           |
| phase end    | the trainer finished a phase of its step (a rate change reschedules)  |
| lend         | a role has waited BORROW_AFTER_S: its share goes to the working roles |

This module wires the parts on one event queue (sim_events.py), for a Setting
(sim_setting.py: the config's knobs); sim_figures.py counts the Result.

A server's steps between two changes have equal rows, and each step adds one token to every
row, so k steps cost k * (step_s + row_s * rows) + cell_s * (k * cells + rows * k(k-1)/2)
at once: an event per join, finish or update, never one per decode step. A request's
first token carries the server's version then (its staleness at training is the trainer's
version minus that one, as areal.trainer.worker.staleness counts it).

Left out: the reward's grading time beyond a constant per group, failures and restarts,
checkpoints, the KV budget's finer rules (SGLang's retraction), dynamic sampling's dropped
groups, agent workflows, data-parallel collectives' skew, and the noise of a shared machine.
"""

from __future__ import annotations

from areal.config import ConfigError
from areal.controller.buffer import ReplayBuffer
from areal.planner.costs import Profile
from areal.planner.sim_controller import ControllerModel
from areal.planner.sim_cores import CoreModel
from areal.planner.sim_events import EventQueue
from areal.planner.sim_figures import (
    Result,
    bottleneck,
    effective_throughput,
    figures,
    warm_steps,
)
from areal.planner.sim_servers import ServerModel, _Group, _Req, _Server
from areal.planner.sim_setting import Setting
from areal.planner.sim_trainer import TrainerModel

__all__ = [
    "EventQueue", "Result", "Setting", "Simulation", "bottleneck", "effective_throughput",
    "simulate", "warm_steps", "_Group", "_Req",
]  # fmt: skip


class Simulation:
    """One run: its parts, on one event queue (sim_events.py), wired to each other.

    CoreModel (sim_cores.py)        who works; each role's threads and rate
    ServerModel (sim_servers.py)    decode steps, joins, finishes, weight loads
    TrainerModel (sim_trainer.py)   batches, a step's phases, versions published
    ControllerModel (sim_controller.py)  gate, router, buffer, fan-out
    figures (sim_figures.py)        the Result, from what they recorded
    """

    def __init__(self, profile: Profile, setting: Setting):
        if setting.n_servers < 1 or setting.batch_size < 1 or setting.group_size < 1:
            raise ConfigError("the planner needs at least one server, one group and one sample")
        self.p, self.s = profile, setting
        self.events = EventQueue()
        prompt = max(1, round(profile.lengths.prompt_len))
        max_len = prompt + setting.max_new_tokens
        rows = setting.max_rows
        if profile.kv_budget:  # the engine's rule: rows x the longest request's max length
            rows = min(rows, max(1, profile.kv_budget // max_len))
        self.cores = CoreModel(self.events, profile, setting.lend, setting.n_servers + 1)
        self.server_model = ServerModel(
            self.events, self.cores, profile, setting.n_servers, rows, setting.interruptible
        )
        buffer = ReplayBuffer()
        self.trainer_model = TrainerModel(
            self.events, self.cores, profile, setting, buffer, slot=setting.n_servers
        )
        self.controller = ControllerModel(
            self.events, profile, setting, buffer, self.server_model, self.trainer_model, prompt
        )
        self.servers: list[_Server] = self.server_model.servers
        self.trainer = self.trainer_model.trainer
        self.cores.roles += [*self.servers, self.trainer]
        self.cores.listeners += [self.server_model.retuned, self.trainer_model.retuned]
        self.server_model.on_generated = self.controller.generated
        self.server_model.on_loaded = self.controller.server_loaded
        self.trainer_model.on_version = self.controller.weights_ready

    def run(self) -> Result:
        self.cores.start()
        self.controller.admit()
        self.trainer_model.request_batch()
        self.events.run(lambda: self.trainer.version >= self.s.steps)
        if self.trainer.version < self.s.steps:
            raise RuntimeError(
                f"the simulated run stopped at step {self.trainer.version}: nothing left to "
                "happen (an internal error: the gate, buffer and trainer disagree)"
            )
        now, srv = self.events.now, self.server_model
        return figures(
            self.trainer_model.records,
            self.trainer_model.staleness,
            self.servers,
            self.trainer,
            self.controller.held_by_max_staleness.until(now),
            self.controller.capped.until(now),
            now,
            self.s.max_staleness,
            self.s.warm_steps,
            generated=srv.generated,
            prefilled=srv.prefilled,
            interrupted=srv.interrupted,
        )

    def _place(self, srv: _Server) -> int:
        """ServerModel.place: the rows of `srv`'s running requests, the cells a step reads."""
        return self.server_model.place(srv)


def simulate(profile: Profile, setting: Setting) -> Result:
    return Simulation(profile, setting).run()
