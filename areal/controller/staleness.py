"""The staleness gate (paper section 5.1): when may a new generation request start?

With current policy version i, training batch size B (in prompt groups) and maximum
staleness eta, a new group may start only if, counting it,

    floor((N_r - 1) / B) <= i + eta        i.e.   N_r <= B * (i + eta + 1)

where N_r counts the groups started so far that were not rejected (in flight, waiting in
the buffer, or already trained on). A rejected group frees its place. eta = 0 is
synchronous RL: the B groups of a batch all start under the version that trains on them.
A cap on groups in flight bounds memory independently of the formula.

After a resume N_r is rebuilt as B * version + (groups restored into the buffer), never
carried over from counters that included lost in-flight work.
"""

from __future__ import annotations


class StalenessGate:
    def __init__(
        self,
        batch_size: int,
        max_staleness: int,
        max_concurrent: int,
        version: int = 0,
        n_accepted: int | None = None,
    ):
        assert batch_size > 0 and max_staleness >= 0 and max_concurrent >= 0
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent or batch_size  # 0: one training batch
        self.version = version
        self.n_running = 0
        """Groups started and not yet accepted or rejected."""
        self.n_accepted = batch_size * version if n_accepted is None else n_accepted
        """Groups finished and kept: in the buffer or already trained on."""

    @property
    def n_started(self) -> int:
        return self.n_accepted + self.n_running

    def capacity(self) -> int:
        """How many more groups may start now."""
        bound = self.batch_size * (self.version + self.max_staleness + 1)
        return max(0, min(bound - self.n_started, self.max_concurrent - self.n_running))

    def on_rollout_submitted(self) -> int:
        """Count a starting group; returns the version it starts under."""
        assert self.capacity() > 0, "a group started past the staleness bound"
        self.n_running += 1
        return self.version

    def on_rollout_accepted(self) -> None:
        assert self.n_running > 0
        self.n_running -= 1
        self.n_accepted += 1

    def on_rollout_rejected(self) -> None:
        assert self.n_running > 0
        self.n_running -= 1

    def on_version(self, version: int) -> None:
        """Every inference server now holds `version`: new groups start under it."""
        assert version >= self.version
        self.version = version
