"""The simulated trainer: one step as a sequence of timed phases.

    request a batch (it waits) --the buffer has batch_size groups within max_staleness
        --> rpc_s -->
        step overhead -> proximal pass (minibatches 2..n) -> n minibatch updates
        (micro-batches by Algorithm 1) -> publish --> on_version(v + 1), next batch

A phase's work runs at the trainer's rate (its threads and the contention for cores); a
change of rate mid-phase reschedules the phase's end for the work left.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from areal.controller.buffer import ReplayBuffer
from areal.planner.costs import Profile, micro_batch_count
from areal.planner.sim_cores import CoreModel, _Role
from areal.planner.sim_events import EventQueue
from areal.planner.sim_servers import _Req
from areal.planner.sim_setting import Setting


@dataclass(eq=False)
class _Trainer(_Role):
    version: int = 0
    wants_batch: bool = False
    phases: list = field(default_factory=list)
    remaining: float = 0.0
    rate: float = 1.0
    threaded: bool = True
    phase_since: float = 0.0
    job_id: int = 0
    batch: list | None = None


class TrainerModel:
    """The trainer's steps: batches from the buffer, phases, versions published."""

    def __init__(
        self,
        events: EventQueue,
        cores: CoreModel,
        profile: Profile,
        setting: Setting,
        buffer: ReplayBuffer,
        slot: int,
    ):
        self.events, self.cores, self.p, self.s = events, cores, profile, setting
        self.buffer = buffer
        self.trainer = _Trainer(slot=slot)
        self.on_version: Callable[[int], None] = lambda version: None
        """A step published `version`."""
        self.records: list[dict] = []
        """Per step: its version, the time it ended, tokens and trajectories trained."""
        self.staleness: list[list[int]] = []
        """Per step: each sample's staleness (the trainer's version minus its first)."""

    def request_batch(self) -> None:
        t = self.trainer
        self.cores.set_working(t, False)
        t.wants_batch = True
        self.give_batch()

    def give_batch(self) -> None:
        """The batch, if the trainer waits for one and the buffer holds it."""
        t = self.trainer
        if not t.wants_batch:
            return
        groups = self.buffer.take(t.version, self.s.batch_size, self.s.max_staleness)
        if groups is None:
            return
        t.wants_batch = False
        self.events.at(self.events.now + self.p.train.rpc_s, self._train, groups)

    def retuned(self) -> None:
        """The cores changed: a phase in progress goes on at the new rate."""
        t = self.trainer
        if t.working and t.phases is not None:
            self._trainer_rate()

    def _train(self, groups: list[list[_Req]]) -> None:
        t, tc, s = self.trainer, self.p.train, self.s
        reqs = [r for g in groups for r in g]
        self.staleness.append([t.version - r.first_version for r in reqs])
        t.batch = reqs
        seqlens = [r.prompt + r.target for r in reqs]
        order = list(range(len(reqs)))
        random.Random(s.seed + t.version).shuffle(order)
        minibatches = [order[k :: s.n_minibatches] for k in range(s.n_minibatches)]
        devices = max(1, s.trainer_devices)
        rest = [i for mb in minibatches[1:] for i in mb]
        prox = tc.proximal_time(sum(seqlens[i] for i in rest), len(rest)) / devices
        phases = [(tc.step_s, False), (prox, True)]
        for mb in minibatches:
            if not mb:
                continue
            lens = [seqlens[i] for i in mb]
            mbs = micro_batch_count(lens, s.max_tokens_per_mb * devices)
            tokens, sq = sum(lens) / devices, sum(n * n for n in lens) / devices
            mbs_each = max(1, math.ceil(mbs / devices))
            phases.append(
                (tc.update_time(tokens, math.ceil(len(mb) / devices), sq, mbs_each), True)
            )
        phases.append((self.p.handoff.publish_s, False))
        t.phases = phases
        self.cores.set_working(t, True)
        self._next_phase()

    def _next_phase(self) -> None:
        t = self.trainer
        if not t.phases:
            self._step_done()
            return
        work, t.threaded = t.phases.pop(0)
        t.remaining, t.phase_since = work, self.events.now
        t.rate = self._phase_rate()
        t.job_id += 1
        self.events.at(self.events.now + work / t.rate, self._phase_end, t.job_id)

    def _phase_rate(self) -> float:
        t = self.trainer
        rate = self.cores.rate(t, self.p.train.speedup if t.threaded else {1: 1.0})
        return max(rate, 1e-9)

    def _trainer_rate(self) -> None:
        t, now = self.trainer, self.events.now
        rate = self._phase_rate()
        if abs(rate - t.rate) < 1e-12:
            return
        t.remaining = max(0.0, t.remaining - (now - t.phase_since) * t.rate)
        t.rate, t.phase_since = rate, now
        t.job_id += 1
        self.events.at(now + t.remaining / rate, self._phase_end, t.job_id)

    def _phase_end(self, job_id: int) -> None:
        if job_id == self.trainer.job_id:
            self._next_phase()

    def _step_done(self) -> None:
        t = self.trainer
        t.version += 1
        tokens = sum(r.target for r in t.batch)
        self.records.append(
            {"step": t.version, "time": self.events.now, "train/n_tokens": tokens,
             "seqs": len(t.batch)}
        )  # fmt: skip
        t.batch = None
        self.on_version(t.version)
        if t.version < self.s.steps:
            self.request_batch()
