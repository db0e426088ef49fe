"""The simulation's cores (CPU profiles): each computing role's threads and speed.

    role starts waiting --BORROW_AFTER_S later, if still waiting--> its share is lent
    threads = share + an equal part of the lent cores (areal/cores.py's Cores.adapt); a
              server lends but never borrows: its threads are its share
    rate = the profile's speed-up at those threads x min(1, cores / threads working)
    a change of who works --> every role's threads; the listeners (servers, trainer) re-rate

On a GPU profile every role runs at rate 1 on its own device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from areal.cores import BORROW_AFTER_S
from areal.planner.costs import Profile, speed
from areal.planner.sim_events import EventQueue


@dataclass(eq=False)
class _Role:
    """A computing role's place in the cores ledger."""

    slot: int
    working: bool = False
    waiting_since: float | None = 0.0
    """Since when it waits (the ledger's slot); None while it works."""
    threads: int = 1
    borrows: bool = True
    """Whether it takes lent cores (the trainer; servers lend only, areal/cores.py)."""
    busy: list[tuple[float, float]] = field(default_factory=list)
    busy_since: float | None = None


class CoreModel:
    """Who works, and each role's threads and rate (areal/cores.py's lending rule)."""

    def __init__(self, events: EventQueue, profile: Profile, lend: bool, n_roles: int):
        self.events = events
        self.lend = lend
        self.cpu = profile.device == "cpu"
        self.roles: list[_Role] = []
        """The n_roles computing roles, in slot order (the simulation adds them)."""
        # Cores (areal/cores.py): each computing role's share, and the node's limit.
        self.cores = profile.cores if self.cpu else 0
        self.share = max(1, self.cores // n_roles) if self.cpu else 1
        self.limit = max(self.share, self.cores)
        self.listeners: list[Callable[[], None]] = []
        """Called, in order, after the threads changed (each re-rates its work)."""

    def start(self) -> None:
        """Every role starts waiting: servers for requests, the trainer for its first batch."""
        for role in self.roles:
            role.threads = self.share
            self.events.at(BORROW_AFTER_S, self._lend, role, 0.0)

    def set_working(self, role: _Role, working: bool) -> None:
        if role.working == working:
            return
        now = self.events.now
        role.working = working
        if working:
            role.waiting_since = None
            role.busy_since = now
        else:
            role.waiting_since = now
            role.busy.append((role.busy_since, now))
            role.busy_since = None
            if self.cpu and self.lend:
                self.events.at(now + BORROW_AFTER_S, self._lend, role, now)
        self._retune()

    def rate(self, role: _Role, speedup: dict[int, float]) -> float:
        if not self.cpu:
            return 1.0
        busy = sum(r.threads for r in self.roles if r.working)
        contention = min(1.0, self.cores / busy) if busy else 1.0
        return speed(speedup, role.threads) * contention

    def _lend(self, role: _Role, since: float) -> None:
        if role.waiting_since == since:
            self._retune()

    def _threads(self, role: _Role) -> int:
        if not self.cpu or not self.lend or not role.borrows:
            return self.share
        # Cores.adapt: the cores beside the holders' shares go to those of them that borrow,
        # in equal parts.
        lent_before = self.events.now - BORROW_AFTER_S + 1e-12
        holders = [
            r
            for r in self.roles
            if r is role or r.waiting_since is None or r.waiting_since > lent_before
        ]
        borrowers = sorted(r.slot for r in holders if r.borrows)
        extra, rest = divmod(max(0, self.limit - self.share * len(holders)), len(borrowers))
        extra += borrowers.index(role.slot) < rest
        return self.share + extra

    def _retune(self) -> None:
        """Threads and rates after a change of who works: a server takes them at its next
        step, the trainer at its next layer (at once, here)."""
        if not self.cpu:
            return
        for role in self.roles:
            role.threads = self._threads(role)
        for listener in self.listeners:
            listener()
