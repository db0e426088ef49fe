"""The simulated controller: StalenessGate and ReplayBuffer (areal/controller/, the very
classes), the router, and the fan-out of each new version.

    gate has capacity --> a group (lengths drawn from the profile) to the server with the
        fewest groups in flight, arriving half the group overhead later
    a group generated --half the overhead--> the gate, the buffer --> the trainer's batch
    a version published --> to every server, one version at a time (the update lock)
        --all loaded, + fanout_s--> the gate moves to it

It also keeps when the gate was shut: by max_staleness, or by the cap on groups in flight.
"""

from __future__ import annotations

import random

from areal.controller.buffer import ReplayBuffer
from areal.controller.staleness import StalenessGate
from areal.planner.costs import Profile
from areal.planner.sim_events import EventQueue
from areal.planner.sim_servers import ServerModel, _Group, _Req
from areal.planner.sim_setting import Setting
from areal.planner.sim_trainer import TrainerModel


class Shut:
    """The spans in which a condition held (the gate shut), the last one maybe still open."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self.since: float | None = None

    def note(self, shut: bool, now: float) -> None:
        if shut and self.since is None:
            self.since = now
        elif not shut and self.since is not None:
            self.spans.append((self.since, now))
            self.since = None

    def until(self, now: float) -> list[tuple[float, float]]:
        """Every span, the open one ending `now`."""
        return [*self.spans, *([(self.since, now)] if self.since is not None else [])]


class ControllerModel:
    """Admission through the gate, routing, the buffer, and the versions' fan-out."""

    def __init__(
        self,
        events: EventQueue,
        profile: Profile,
        setting: Setting,
        buffer: ReplayBuffer,
        servers: ServerModel,
        trainer: TrainerModel,
        prompt: int,
    ):
        self.events, self.p, self.s = events, profile, setting
        self.lengths = profile.lengths.draws(
            random.Random(setting.seed), setting.group_size, setting.max_new_tokens
        )
        self.prompt = prompt
        self.gate = StalenessGate(setting.batch_size, setting.max_staleness, setting.max_concurrent)
        self.buffer = buffer
        self.servers, self.trainer = servers, trainer
        self.load = [0] * setting.n_servers
        """Groups in flight per server (the router's)."""
        self.pending_versions: list[int] = []
        self.fanning = False
        self.loaded = 0
        self.held_by_max_staleness = Shut()
        self.capped = Shut()
        """When the bound on staleness, and the cap on groups in flight, kept the gate shut."""

    def admit(self) -> None:
        while self.gate.capacity() > 0:
            start_version = self.gate.on_rollout_submitted()
            gid = self.buffer.reserve(start_version)
            k = min(range(len(self.load)), key=lambda i: self.load[i])  # router.pick
            self.load[k] += 1
            group = _Group(gid, start_version, k)
            group.reqs = [_Req(self.prompt, n, group) for n in next(self.lengths)]
            arrival = self.events.now + self.p.group_overhead_s / 2
            self.events.at(arrival, self.servers.arrive, group)
        self._track_held()

    def _track_held(self) -> None:
        """Intervals in which the gate is shut by max_staleness, and by the cap on groups in
        flight."""
        g = self.gate
        by_staleness = g.batch_size * (g.version + g.max_staleness + 1) - g.n_started <= 0
        by_cap = not by_staleness and g.max_concurrent - g.n_running <= 0
        self.held_by_max_staleness.note(by_staleness, self.events.now)
        self.capped.note(by_cap, self.events.now)

    def generated(self, group: _Group) -> None:
        """A group's last sample finished on its server."""
        self.load[group.server] -= 1
        self.events.at(self.events.now + self.p.group_overhead_s / 2, self._group_done, group)

    def _group_done(self, group: _Group) -> None:
        self.gate.on_rollout_accepted()
        self.buffer.put(group.gid, group.reqs)
        self.trainer.give_batch()
        self.admit()

    def weights_ready(self, version: int) -> None:
        self.pending_versions.append(version)
        self._fan_out()

    def _fan_out(self) -> None:
        """One version at a time (the controller's update lock), to every server."""
        if self.fanning or not self.pending_versions:
            return
        version = self.pending_versions.pop(0)
        self.fanning, self.loaded = True, 0
        for srv in self.servers.servers:
            self.servers.update(srv, version)

    def server_loaded(self, version: int) -> None:
        self.loaded += 1
        if self.loaded == len(self.servers.servers):
            self.events.at(self.events.now + self.p.handoff.fanout_s, self._version_done, version)

    def _version_done(self, version: int) -> None:
        self.gate.on_version(version)
        self.fanning = False
        self.admit()
        self._fan_out()
