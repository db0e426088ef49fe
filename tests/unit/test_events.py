"""Event spans: buffered per-role files, merged by the reader; the server's lane; role logs."""

from __future__ import annotations

import io
import json
import logging
import time

import pytest

from areal import events, rolelog
from areal.rollout.activity import DecodeMeter, ServerActivity


@pytest.fixture
def event_log(tmp_path, monkeypatch):
    """A configured process-wide EventLog, removed afterwards."""
    monkeypatch.setattr(events, "_log", None)
    monkeypatch.setattr(events, "CPU_SAMPLE_S", 3600)  # no `cpu` record among the spans
    log = events.configure(events.events_path(tmp_path, "server0"), "server0")
    yield log
    log.close()
    monkeypatch.setattr(events, "_log", None)


def test_a_configured_process_samples_its_cpu_seconds(tmp_path, monkeypatch):
    monkeypatch.setattr(events, "_log", None)
    monkeypatch.setattr(events, "CPU_SAMPLE_S", 0.05)
    log = events.configure(events.events_path(tmp_path, "controller0"), "controller0")
    busy_until = time.process_time() + 0.2
    while time.process_time() < busy_until:  # 0.2 CPU-s in this process
        pass

    def samples() -> list[dict]:
        log.flush()
        return [e for e in events.read_events(tmp_path) if e["kind"] == "cpu"]

    deadline = time.monotonic() + 10  # until the samples cover the busy loop
    while (len(cpu := samples()) < 3 or sum(e["cpu_s"] for e in cpu) < 0.15) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.01)
    log.close()
    monkeypatch.setattr(events, "_log", None)
    cpu = [e for e in events.read_events(tmp_path) if e["kind"] == "cpu"]
    assert len(cpu) >= 3 and all(e["role"] == "controller0" for e in cpu)
    assert all(a["end"] == b["start"] for a, b in zip(cpu, cpu[1:], strict=False))
    assert 0.15 <= sum(e["cpu_s"] for e in cpu) <= sum(e["end"] - e["start"] for e in cpu) + 0.05


def test_spans_are_buffered_then_written_whole(tmp_path):
    path = events.events_path(tmp_path, "trainer0")
    log = events.EventLog(path, "trainer0", flush_interval_s=3600)
    log.record("update", 10.0, 10.5, version=3)
    log.record("publish", 10.5, 10.6, version=4)
    assert path.read_text() == ""  # buffered: no write per span
    log.flush()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [
        {"role": "trainer0", "kind": "update", "start": 10.0, "end": 10.5, "version": 3},
        {"role": "trainer0", "kind": "publish", "start": 10.5, "end": 10.6, "version": 4},
    ]
    log.record("wait_batch", 10.6, 11.0, version=4)
    log.close()  # close writes what is left
    assert len(path.read_text().splitlines()) == 3


def test_a_span_older_than_the_interval_flushes(tmp_path):
    path = tmp_path / "e.jsonl"
    log = events.EventLog(path, "controller0", flush_interval_s=1.0)
    log._last_flush = 100.0
    log.record("update_weights", 100.2, 100.5, version=1)
    assert path.read_text() == ""
    log.record("update_weights", 100.9, 101.2, version=2)  # ends 1.2 s after the last flush
    assert len(path.read_text().splitlines()) == 2
    log.close()


def test_unknown_kind_is_a_bug(tmp_path):
    log = events.EventLog(tmp_path / "e.jsonl", "x")
    with pytest.raises(AssertionError):
        log.record("napping", 0.0, 1.0)
    log.close()


def test_read_events_merges_roles_by_start_and_skips_a_torn_line(tmp_path):
    d = events.events_dir(tmp_path)
    d.mkdir()
    span = {"kind": "generate", "start": 2.0, "end": 3.0}
    (d / "server0.jsonl").write_text(json.dumps({"role": "server0", **span}) + "\n")
    (d / "trainer0.jsonl").write_text(
        json.dumps({"role": "trainer0", "kind": "update", "start": 1.0, "end": 2.5})
        + '\n{"role": "trainer0", "kind": "upd'  # the process died mid-line
    )
    merged = events.read_events(tmp_path)
    assert [(e["role"], e["start"]) for e in merged] == [("trainer0", 1.0), ("server0", 2.0)]
    assert events.read_events(tmp_path / "nowhere") == []


def test_span_without_a_configured_log_does_nothing(tmp_path, monkeypatch):
    """stats.events=false: spans cost nothing and write nowhere (not even a default file)."""
    monkeypatch.setattr(events, "_log", None)
    monkeypatch.chdir(tmp_path)
    with events.span("update", version=1):
        pass
    events.record("update", 0.0, 1.0)
    events.flush()
    assert events._log is None
    assert list(tmp_path.rglob("*")) == []


def test_span_records_even_when_the_block_raises(event_log):
    with pytest.raises(RuntimeError), events.span("load", version=2):
        raise RuntimeError("boom")
    event_log.flush()
    (line,) = event_log.path.read_text().splitlines()
    assert json.loads(line)["kind"] == "load" and json.loads(line)["version"] == 2


def _kinds(log) -> list[tuple[str, int | None]]:
    log.flush()
    return [(e["kind"], e["version"]) for e in map(json.loads, log.path.read_text().splitlines())]


def test_decode_windows_sum_steps_and_close_on_a_gap_threads_or_length(event_log):
    meter = DecodeMeter()
    meter.step(0.000, 0.002, rows=4, cells=40, read=48, prefill=30, prefill_rows=4, threads=1)
    meter.step(0.002, 0.003, rows=4, cells=44, read=52, prefill=0, prefill_rows=0, threads=1)
    # Then a gap, a change of threads, a window's length.
    meter.step(0.100, 0.101, rows=2, cells=30, read=30, prefill=0, prefill_rows=0, threads=1)
    meter.step(0.101, 0.102, rows=2, cells=32, read=32, prefill=0, prefill_rows=0, threads=2)
    meter.step(0.102, 0.500, rows=2, cells=34, read=34, prefill=0, prefill_rows=0, threads=2)
    meter.flush()
    event_log.flush()
    spans = [json.loads(x) for x in event_log.path.read_text().splitlines()]
    keys = ("kind", "start", "end", "steps", "rows", "cells", "read")
    assert [tuple(s[k] for k in keys) for s in spans] == [
        ("decode", 0.0, 0.003, 2, 8, 84, 100), ("decode", 0.1, 0.101, 1, 2, 30, 30),
        ("decode", 0.101, 0.102, 1, 2, 32, 32), ("decode", 0.102, 0.5, 1, 2, 34, 34),
    ]  # fmt: skip
    assert spans[0]["prefill"] == 30 and spans[0]["prefill_rows"] == 4
    assert [s["threads"] for s in spans] == [1, 1, 2, 2]


def test_server_lane_generate_pause_load_continue(event_log):
    version = {"v": 0}
    activity = ServerActivity(lambda: version["v"])
    activity.request_started()
    activity.request_started()
    activity.request_finished()  # one still in flight: still generating
    assert _kinds(event_log) == []
    activity.paused()  # an update: the generate span ends, the pause begins
    activity.request_finished()  # the aborted request returns during the pause
    activity.request_started()  # and is resubmitted: held, not generating
    with activity.loading(1):
        version["v"] = 1
    activity.continued()  # the held request generates again, under version 1
    activity.request_finished()
    assert _kinds(event_log) == [("generate", 0), ("load", 1), ("pause", 1), ("generate", 1)]


def test_server_lane_idle_server_records_nothing_but_loads(event_log):
    activity = ServerActivity(lambda: None)
    with activity.loading(None):  # a non-interruptible update of an idle server
        pass
    activity.continued()  # a continue without a pause
    assert _kinds(event_log) == [("load", None)]


def test_role_log_lines_carry_time_role_and_context():
    stream = io.StringIO()
    log = logging.getLogger("areal.test_rolelog")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(rolelog.make_handler("trainer1", stream))
    rolelog.set_context(step=None, version=None)
    try:
        log.info("before")
        rolelog.set_context(step=5, version=4)
        log.info("during")
        holder = {"v": 7}
        rolelog.set_context(step=None, version=lambda: holder["v"])
        holder["v"] = 8  # read at each line
        log.info("callable")
    finally:
        rolelog.set_context(step=None, version=None)
        log.handlers.clear()
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("trainer1 [-] areal.test_rolelog INFO: before")
    assert "trainer1 [step 5 version 4] areal.test_rolelog INFO: during" in lines[1]
    assert "trainer1 [version 8] areal.test_rolelog INFO: callable" in lines[2]
    assert lines[1][:4].isdigit()  # starts with the date
