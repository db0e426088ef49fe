"""The staleness gate and the replay buffer, driven through random event orders."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.controller.buffer import ReplayBuffer
from areal.controller.staleness import StalenessGate
from areal.trajectory import Trajectory


def test_gate_formula():
    # B=4, eta=1, version 0: floor((N_r - 1) / 4) <= 1  <=>  N_r <= 8.
    gate = StalenessGate(batch_size=4, max_staleness=1, max_concurrent=100)
    assert gate.capacity() == 8
    for _ in range(8):
        assert gate.on_rollout_submitted() == 0
    assert gate.capacity() == 0
    gate.on_rollout_rejected()  # a rejected group frees its place
    assert gate.capacity() == 1
    gate.on_version(1)  # N_r <= 4 * (1 + 1 + 1) = 12; 7 started
    assert gate.capacity() == 5
    assert gate.on_rollout_submitted() == 1


def test_gate_caps_groups_in_flight():
    gate = StalenessGate(batch_size=4, max_staleness=8, max_concurrent=3)
    for _ in range(3):
        gate.on_rollout_submitted()
    assert gate.capacity() == 0
    gate.on_rollout_accepted()
    assert gate.capacity() == 1


def test_max_concurrent_zero_is_one_training_batch():
    gate = StalenessGate(batch_size=4, max_staleness=8, max_concurrent=0)
    assert gate.capacity() == 4  # the bound alone would allow 4 * 9
    for _ in range(4):
        gate.on_rollout_submitted()
    assert gate.capacity() == 0
    gate.on_rollout_accepted()
    assert gate.capacity() == 1


def test_gate_after_resume_counts_from_the_version():
    gate = StalenessGate(batch_size=4, max_staleness=2, max_concurrent=100, version=5)
    assert gate.n_accepted == 20  # B * version groups were trained on
    assert gate.capacity() == 4 * (5 + 2 + 1) - 20


def _group(group_id: int, start_version: int = 0) -> list[Trajectory]:
    return [Trajectory(group_id=group_id, prompt_ids=[1], start_version=start_version)]


def test_buffer_oldest_first_each_once():
    buf = ReplayBuffer()
    idx = [buf.reserve(0) for _ in range(4)]
    for i in reversed(idx):
        buf.put(i, _group(i))
    first = buf.take(version=0, batch_size=2, max_staleness=1)
    assert [g[0].group_id for g in first] == [0, 1]
    second = buf.take(version=1, batch_size=2, max_staleness=1)
    assert [g[0].group_id for g in second] == [2, 3]
    assert buf.take(version=2, batch_size=2, max_staleness=1) is None


def test_buffer_waits_for_a_slow_group_that_would_become_too_stale():
    # eta = 1: 2B groups start under version 0. Batch 0 takes two of them; the third is
    # slow. Batch 1 must contain it (deadline 0 + 1), so the trainer waits for it rather
    # than train on the newer, faster group 4.
    buf = ReplayBuffer()
    for _ in range(4):
        buf.reserve(0)
    for i in (0, 1, 3):
        buf.put(i, _group(i))
    assert [g[0].group_id for g in buf.take(0, 2, 1)] == [0, 1]
    newer = buf.reserve(1)
    buf.put(newer, _group(newer))
    assert buf.take(1, 2, 1) is None
    buf.put(2, _group(2))
    assert [g[0].group_id for g in buf.take(1, 2, 1)] == [2, 3]


@st.composite
def scenarios(draw):
    return (
        draw(st.integers(1, 4)),  # B
        draw(st.integers(0, 3)),  # eta
        draw(st.integers(1, 12)),  # max groups in flight
        draw(st.lists(st.tuples(st.sampled_from("sfrta"), st.integers(0, 10**6)), max_size=300)),
    )


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_random_orders_keep_every_invariant(scenario):
    """Starts, finishes, rejections, trainer takes and version acknowledgements in any
    order: no trained group staler than eta, none used twice, none lost, no deadlock, and
    eta = 0 exactly synchronous."""
    B, eta, max_concurrent, events = scenario
    gate = StalenessGate(B, eta, max_concurrent)
    buf = ReplayBuffer()
    in_flight: dict[int, int] = {}  # group id -> start version
    accepted: set[int] = set()
    trained: list[int] = []
    trainer_version = 0

    def finish(group_id: int, keep: bool) -> None:
        start_version = in_flight.pop(group_id)
        if keep:
            gate.on_rollout_accepted()
            buf.put(group_id, _group(group_id, start_version))
            accepted.add(group_id)
        else:
            gate.on_rollout_rejected()
            buf.discard(group_id)

    def take() -> bool:
        nonlocal trainer_version
        batch = buf.take(trainer_version, B, eta)
        if batch is None:
            return False
        assert len(batch) == B
        for g in batch:
            group_id = g[0].group_id
            start = g[0].start_version
            assert trainer_version - start <= eta, "a trained group is staler than eta"
            if eta == 0:
                assert start == trainer_version
            assert group_id not in trained, "a group was trained on twice"
            trained.append(group_id)
        trainer_version += 1
        return True

    def start() -> None:
        v = gate.on_rollout_submitted()
        group_id = buf.reserve(v)
        in_flight[group_id] = v

    for kind, r in events:
        if kind == "s" and gate.capacity() > 0:
            start()
        elif kind in "fr" and in_flight:
            finish(sorted(in_flight)[r % len(in_flight)], keep=kind == "f")
        elif kind == "t":
            take()
        elif kind == "a" and gate.version < trainer_version:
            gate.on_version(gate.version + 1)  # servers acknowledge the next version

    # Liveness: finishing groups, acknowledging versions and starting new groups always
    # lets training go on.
    for _ in range(20):
        gate.on_version(trainer_version)
        while not take():
            if in_flight:
                finish(min(in_flight), keep=True)
            else:
                assert gate.capacity() > 0, "training deadlocked"
                start()
        gate.on_version(trainer_version)
    # Nothing lost: every accepted group was trained on or still waits in the buffer.
    assert set(trained) | {i for i in accepted if i not in trained} == accepted
    assert len(buf) == len(accepted) - len(trained)


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_take_never_exceeds_the_bound_when_old_groups_are_slow(eta):
    """Adversarial: the oldest in-flight group always finishes last."""
    B = 2
    gate = StalenessGate(B, eta, 100)
    buf = ReplayBuffer()
    in_flight: dict[int, int] = {}
    version = 0
    for _ in range(30):
        gate.on_version(version)
        while gate.capacity() > 0:
            v = gate.on_rollout_submitted()
            in_flight[buf.reserve(v)] = v
        batch = buf.take(version, B, eta)
        while batch is None:
            newest = max(in_flight)
            gate.on_rollout_accepted()
            buf.put(newest, _group(newest, in_flight.pop(newest)))
            batch = buf.take(version, B, eta)
        assert all(version - g[0].start_version <= eta for g in batch)
        version += 1
    assert version == 30
