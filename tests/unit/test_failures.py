"""The rule that ends a run whose episodes only fail (areal/controller/failures.py)."""

from __future__ import annotations

from areal.controller.failures import REPORT_MARK, FailureWatch


def _error(message: str) -> RuntimeError:
    try:
        raise RuntimeError(message)
    except RuntimeError as e:  # a real traceback, as the controller's errors have
        return e


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_n_consecutive_rejections_end_the_run_with_the_first_traceback():
    watch = FailureWatch(max_consecutive=3, window_s=0, clock=Clock())
    assert watch.rejected(_error("tools are not supported")) is None
    assert watch.rejected(_error("second")) is None
    report = watch.rejected(_error("third"))
    assert report.startswith(REPORT_MARK)
    assert "the last 3 episodes were all rejected (rollout.max_consecutive_failures=3)" in report
    assert "Traceback" in report and "RuntimeError: tools are not supported" in report
    assert "The latest: RuntimeError: third" in report


def test_an_accepted_episode_starts_the_count_again():
    watch = FailureWatch(max_consecutive=3, window_s=0, clock=Clock())
    for _ in range(10):
        assert watch.rejected(_error("a")) is None
        assert watch.rejected(_error("b")) is None
        watch.accepted()


def test_a_window_of_only_rejections_ends_the_run():
    clock = Clock()
    watch = FailureWatch(max_consecutive=0, window_s=60, clock=clock)
    assert watch.rejected(_error("first")) is None
    clock.now += 59
    assert watch.rejected(_error("again")) is None
    clock.now += 1
    report = watch.rejected(_error("still"))
    assert "every episode for 60 s was rejected, 3 of them (rollout.failure_window_s=60)" in report
    assert "RuntimeError: first" in report


def test_the_window_counts_from_the_first_rejection_after_an_accepted_episode():
    clock = Clock()
    watch = FailureWatch(max_consecutive=0, window_s=60, clock=clock)
    watch.rejected(_error("old"))
    clock.now += 50
    watch.accepted()
    clock.now += 50  # 100 s after the first rejection, but only the new ones count
    assert watch.rejected(_error("new")) is None
    clock.now += 59
    assert watch.rejected(_error("newer")) is None


def test_zero_turns_both_rules_off():
    clock = Clock()
    watch = FailureWatch(max_consecutive=0, window_s=0, clock=clock)
    for _ in range(1000):
        clock.now += 10
        assert watch.rejected(_error("x")) is None
