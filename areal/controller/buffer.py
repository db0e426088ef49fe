"""The replay buffer: groups wait here between generation and training, oldest first, each
used exactly once.

A group that started under version s must be trained on by trainer version s + eta (its
deadline). Taking the oldest ready groups is earliest-deadline-first, but on its own it can
pass over slow old groups until more of them are due than a batch holds. So a batch is
handed out only if what stays behind can still meet its deadlines: for every deadline d,
the groups left with deadline <= d fit in the batches i+1 .. d, that is
count <= B * (d - i). Otherwise the trainer waits for older groups to finish. Groups the
gate admits later start under versions >= the current one and cannot break this (their
count is bounded by the gate formula). With eta = 0 every batch is exactly the B groups
of its own version.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal.trajectory import Trajectory, TrajectoryRef


@dataclass
class _Slot:
    start_version: int
    group: list[Trajectory | TrajectoryRef] | None = None
    """None while the group is still generating."""


class ReplayBuffer:
    def __init__(self) -> None:
        self._slots: dict[int, _Slot] = {}  # by group id
        self._next_group_id = 0

    def reserve(self, start_version: int) -> int:
        """Register a group that starts generating; returns its group id (start order)."""
        group_id = self._next_group_id
        self._next_group_id += 1
        self._slots[group_id] = _Slot(start_version)
        return group_id

    def put(self, group_id: int, group: list[Trajectory | TrajectoryRef]) -> None:
        """The group finished generating and was graded."""
        assert self._slots[group_id].group is None, "a group was put twice"
        self._slots[group_id].group = group

    def discard(self, group_id: int) -> None:
        """The group was rejected: it will never be trained on."""
        del self._slots[group_id]

    def __len__(self) -> int:
        """Groups ready to train on."""
        return sum(s.group is not None for s in self._slots.values())

    @property
    def n_in_flight(self) -> int:
        return sum(s.group is None for s in self._slots.values())

    def take(
        self, version: int, batch_size: int, max_staleness: int
    ) -> list[list[Trajectory | TrajectoryRef]] | None:
        """The batch for trainer version `version`, or None if it must wait.

        Returned groups leave the buffer, in start order.
        """
        ready = sorted(
            (i for i, s in self._slots.items() if s.group is not None),
            key=lambda i: (self._slots[i].start_version, i),
        )
        if len(ready) < batch_size:
            return None
        chosen = set(ready[:batch_size])
        left = sorted(
            s.start_version + max_staleness for i, s in self._slots.items() if i not in chosen
        )
        for n_due, deadline in enumerate(left, start=1):
            if n_due > batch_size * (deadline - version):
                return None
        return [self._slots.pop(i).group for i in sorted(chosen)]

    def state_dict(self) -> dict:
        """Ready groups only: groups in flight at a checkpoint are generated again, and so
        are ready groups held elsewhere (references: their holders stop with the run), whose
        draws are listed under "held_draw_ids"."""
        held = {i for i, s in self._slots.items() if s.group and _by_reference(s.group)}
        return {
            "held_draw_ids": sorted(self._slots[i].group[0].draw_id for i in held),
            "next_group_id": self._next_group_id,  # never reused, resumes included
            "groups": [
                {
                    "group_id": i,
                    "start_version": s.start_version,
                    "group": [t.to_wire() for t in s.group],
                }
                for i, s in sorted(self._slots.items())
                if s.group is not None and i not in held
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        self._slots = {}
        for g in state["groups"]:
            # "index" and "next_index": checkpoints written before the group id had its name.
            group_id = g["group_id"] if "group_id" in g else g["index"]
            group = [Trajectory.from_wire(t) for t in g["group"]]
            self._slots[group_id] = _Slot(g["start_version"], group)
        saved = state.get("next_group_id", state.get("next_index", 0))
        self._next_group_id = max(saved, max(self._slots, default=-1) + 1)


def _by_reference(group: list[Trajectory | TrajectoryRef]) -> bool:
    return any(isinstance(t, TrajectoryRef) for t in group)
