"""The console names what a starting run waits for (launcher/progress.py StartWaits): after
NOTICE_S of one wait, again every REPEAT_S, silent once the first step is in."""

from __future__ import annotations

from areal.launcher.progress import NOTICE_S, REPEAT_S, StartWaits


def test_each_wait_is_named_after_two_seconds_and_then_only_every_thirty():
    now, up, said = [0.0], set(), []
    waits = StartWaits(
        lambda role, k: (role, k) in up,
        [("reward", 0), ("rollout", 0), ("controller", 0)],
        "the first batch",
        said.append,
        clock=lambda: now[0],
    )

    def at(t: float, stepped: bool = False) -> None:
        now[0] = t
        waits.poll(stepped)

    at(1.0)
    assert said == []  # a short wait is not worth a line
    at(1.0 + NOTICE_S)
    assert said == [
        "areal: waiting for reward0 to start, server0 to load the model, controller0 to start "
        "(3 s so far)"
    ]
    at(10.0)
    up.update({("reward", 0), ("controller", 0)})
    at(11.0)
    assert len(said) == 1  # fewer roles to wait for: the same wait
    at(3.0 + REPEAT_S)
    assert said[-1] == "areal: waiting for server0 to load the model (33 s so far)"
    up.add(("rollout", 0))
    at(50.0)
    at(53.0)
    assert said[-1] == "areal: waiting for the first batch (3 s so far)"
    n = len(said)
    at(60.0, stepped=True)
    at(200.0)
    assert len(said) == n  # the run is under way
    waits.begin()  # a recovery: its roles start again
    at(203.0)
    assert said[-1] == "areal: waiting for the first batch (3 s so far)"
