"""Timestamped spans of what each role is doing: the raw material of a run's timeline.

    role process --span(kind)--> EventLog buffer --(at most once a second, at exit)-->
        {exp_dir}/events/{role}.jsonl          one file per role process
    areal.report --read_events(exp_dir)--> every role's spans, merged, sorted by start

Each role process writes its own file, so no two processes ever append to one file (no
lock, no interleaved lines on NFS) and the reader merges them. A line is one finished span:

    {"role": "server0", "kind": "load", "start": 1700000000.1, "end": 1700000000.3, "version": 7}

`start` and `end` are wall-clock seconds (time.time(), comparable across the processes of
one machine, and across NTP-synchronised nodes). `version` is the policy version the span
is about: the one loaded, published, or held while generating. Kinds, by role:

| role          | kind             | span                                                        |
|---------------|------------------|-------------------------------------------------------------|
| server{k}     | generate         | requests in flight and not paused                           |
|               | pause            | /pause_generation until /continue_generation, or an         |
|               |                  | /update_weights_from_disk with abort_all_requests           |
|               | load             | /update_weights_from_disk of `version`                      |
|               | decode           | a window of decode steps (embedded engine): `steps`,        |
|               |                  | `rows`, `cells` (context tokens), `read` (cells attention   |
|               |                  | read), `prefill` tokens of `prefill_rows`, `threads`        |
| trainer{r}    | wait_batch       | asking for (rank 0) or receiving (ranks > 0) the next batch |
|               | proximal         | the no-grad forward pass of the proximal log-probs          |
|               | reference        | the reference policy's forward pass (ppo.kl_coef > 0)       |
|               | update           | one PPO minibatch: forward, backward, optimizer step        |
|               |                  | (`tokens`, `seqs`, `mbs`: what it computed; proximal too)   |
|               | publish          | writing weights/v`version` and telling the controller       |
|               | checkpoint       | saving a checkpoint                                         |
| controller0   | update_weights   | fan-out of `version` until every server has loaded it      |
| server{k},    | borrow           | computing on the cores of `lent` waiting roles of the node  |
| trainer{r}    |                  | (areal/cores.py; overlaps the spans above)                  |
| every role    | cpu              | not a span of work: the process's CPU seconds (`cpu_s`, all |
|               |                  | its threads) since the previous sample, every              |
|               |                  | CPU_SAMPLE_S (the planner's share of the other processes)   |

Recording costs a dict, a json.dumps and a list append: a process-wide EventLog is set up
once by `configure` (areal.worker, the embedded server), and `span`/`record` do nothing in
a process that did not configure one (unit tests, eval).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FLUSH_INTERVAL_S = 1.0
"""Buffered spans reach the file at most this long after they end (and at exit)."""
CPU_SAMPLE_S = 2.0
"""How often a configured process records its CPU seconds (a `cpu` record)."""

KINDS = {
    "generate": "generating",
    "pause": "paused (interrupted by a weight update)",
    "load": "loading weights",
    "decode": "decode steps (a window)",
    "wait_batch": "waiting for a batch",
    "pull": "fetching its share of the batch from the holders (the pull data plane)",
    "proximal": "proximal log-prob pass",
    "reference": "reference policy pass (KL)",
    "update": "PPO minibatch update",
    "values": "critic's value pass (ppo.adv_estimator=gae)",
    "critic_update": "critic's minibatch update (ppo.adv_estimator=gae)",
    "publish": "publishing weights",
    "checkpoint": "saving a checkpoint",
    "update_weights": "weight update fan-out",
    "borrow": "on cores a waiting role lent",
    "cpu": "the process's CPU seconds (a sample)",
}
"""Every span kind and what it means (the report's legend)."""


def events_dir(exp_dir: str | Path) -> Path:
    return Path(exp_dir) / "events"


def events_path(exp_dir: str | Path, role: str) -> Path:
    return events_dir(exp_dir) / f"{role}.jsonl"


class EventLog:
    """Buffered appends of finished spans to one JSONL file; safe from several threads."""

    def __init__(self, path: str | Path, role: str, flush_interval_s: float = FLUSH_INTERVAL_S):
        self.path = Path(path)
        self.role = role
        self.flush_interval_s = flush_interval_s
        self._lines: list[str] = []
        self._last_flush = time.time()
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Append: a restarted server goes on with the file its previous process wrote.
        self._file = open(self.path, "a")  # noqa: SIM115 (closed by close())

    def record(self, kind: str, start: float, end: float, **fields: Any) -> None:
        assert kind in KINDS, kind
        line = json.dumps({"role": self.role, "kind": kind, "start": start, "end": end, **fields})
        with self._lock:
            self._lines.append(line)
            if end - self._last_flush >= self.flush_interval_s:
                self._flush_locked(end)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked(time.time())

    def _flush_locked(self, now: float) -> None:
        self._last_flush = now
        if self._lines and not self._file.closed:
            self._file.write("".join(line + "\n" for line in self._lines))
            self._file.flush()
            self._lines.clear()

    def close(self) -> None:
        self.closed.set()
        self.flush()
        with self._lock:
            self._file.close()


_log: EventLog | None = None


def configure(path: str | Path, role: str) -> EventLog:
    """Record this process's spans as `role` to `path` (events_path(exp_dir, role) in a run);
    the buffer is written at exit. A daemon thread samples the process's CPU seconds."""
    global _log
    if _log is not None:
        _log.close()
    _log = EventLog(path, role)
    atexit.register(_log.close)
    threading.Thread(target=_sample_cpu, args=(_log,), name="events-cpu", daemon=True).start()
    return _log


def _sample_cpu(log: EventLog) -> None:
    """`cpu` records of `log`'s process until it closes: the CPU the roles that record few
    spans use (controller, rollout worker, reward service), which the planner counts."""
    t, cpu = time.time(), time.process_time()
    while not log.closed.wait(CPU_SAMPLE_S):
        now, now_cpu = time.time(), time.process_time()
        log.record("cpu", t, now, cpu_s=round(now_cpu - cpu, 4))
        t, cpu = now, now_cpu


def flush() -> None:
    """Write the buffered spans now (before a signal-driven exit that skips atexit)."""
    if _log is not None:
        _log.flush()


def record(kind: str, start: float, end: float, **fields: Any) -> None:
    """One finished span of this process's role; nothing when no EventLog is configured."""
    if _log is not None:
        _log.record(kind, start, end, **fields)


@contextlib.contextmanager
def span(kind: str, **fields: Any) -> Iterator[None]:
    """Record the time the block takes as a span of `kind` (also when it raises)."""
    if _log is None:
        yield
        return
    start = time.time()
    try:
        yield
    finally:
        _log.record(kind, start, time.time(), **fields)


def read_events(exp_dir: str | Path) -> list[dict]:
    """Every role's spans, merged and sorted by start; [] when the run recorded none.

    A line cut short by a crash (the last of a file) is skipped: a span is either whole
    or absent."""
    spans = []
    for path in sorted(events_dir(exp_dir).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    spans.sort(key=lambda s: s["start"])
    return spans
