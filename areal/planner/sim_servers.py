"""The simulated inference servers: continuous batching in runs of equal decode steps, and
weight updates (interrupting, or draining for the ablation).

    arrive(group) --> queue --plan: join between steps (up to max_rows)--> a segment of k
        equal steps (k: until the first request finishes) --segment end--> finished
        requests; a group's last --> on_generated(group)
    update(version) --> abort after the step in flight (or drain) --load_s--> load done
        --> on_loaded(version); the held requests are prefilled again under it

A server's steps between two changes have equal rows, and each step adds one token to every
row, so k steps cost k * (step_s + row_s * rows) + cell_s * (k * cells + rows * k(k-1)/2)
at once: an event per join, finish or update, never one per decode step.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from areal.planner.costs import Profile
from areal.planner.sim_cores import CoreModel, _Role
from areal.planner.sim_events import EventQueue
from areal.rollout.chunks import attention_chunks, cells_read


@dataclass(eq=False)
class _Req:
    prompt: int
    target: int
    group: _Group
    g: int = 0
    """Tokens generated so far (while running: as of the server's clock at join)."""
    cached: bool = False
    first_version: int | None = None
    join_clock: int = 0


@dataclass(eq=False)
class _Group:
    gid: int
    start_version: int
    server: int
    reqs: list[_Req] = field(default_factory=list)
    n_done: int = 0


@dataclass
class _Segment:
    """A server's run of k decode steps of equal rows, from t0 (costs at its rate)."""

    t0: float
    rows: int
    cells: int
    """Cells the first step reads (each step adds `rows`): on a CPU the embedded engine's
    attention chunks over its rows (areal/rollout/chunks.py), on a GPU the contexts' sum."""
    prefill_s: float
    """The first step's prefill of the rows not cached."""
    per_step_s: float
    """step_s + row_s * rows, at the rate."""
    cell_s: float
    rate: float
    k: int
    prefilled: int
    """Tokens that prefill computes."""

    def time(self, k: int) -> float:
        """Seconds of its first k steps."""
        return (
            self.prefill_s
            + k * self.per_step_s
            + self.cell_s * (k * self.cells + self.rows * k * (k - 1) / 2)
        )

    def steps_by(self, elapsed: float) -> int:
        """Steps done `elapsed` seconds in: the largest k with time(k) <= elapsed."""
        qa = self.cell_s * self.rows / 2  # time(k) is a quadratic in k
        qb = self.per_step_s + self.cell_s * self.cells - qa
        qc = self.prefill_s - elapsed
        if qa > 0:
            k = math.floor((-qb + math.sqrt(max(0.0, qb * qb - 4 * qa * qc))) / (2 * qa))
        else:
            k = math.floor(-qc / qb) if qb > 0 else self.k
        k = min(max(0, k), self.k)
        while k > 0 and self.time(k) > elapsed:  # float safety, both ways
            k -= 1
        while k < self.k and self.time(k + 1) <= elapsed:
            k += 1
        return k


@dataclass(eq=False)
class _Server(_Role):
    borrows: bool = False  # a server lends its core but never borrows (areal/cores.py)
    index: int = 0
    version: int = 0
    clock: int = 0
    """Decode steps done: a running request's tokens are g + clock - join_clock."""
    running: dict = field(default_factory=dict)
    heap: list = field(default_factory=list)
    rows: list[_Req] = field(default_factory=list)
    """The running requests in the engine's cache-row order (DecodeEngine._place)."""
    queue: list[_Req] = field(default_factory=list)
    held: list[_Req] = field(default_factory=list)
    prefill: list[_Req] = field(default_factory=list)
    seg: _Segment | None = None
    seg_id: int = 0
    loading: bool = False
    plan_pending: bool = False
    stall_until: float = 0.0
    draining: int | None = None
    interrupt: tuple[int, float] | None = None


def _prefill_work(srv: _Server) -> tuple[int, int]:
    """Tokens and rows the next step's prefill computes, by DecodeEngine._prefill's rule: a
    request without output yet shares its prompt with a group member prefilled alongside or
    already cached; one resumed with output has a prefix of its own."""
    held = {r.group for r in srv.running if r.cached}
    tokens = rows = 0
    for req in srv.prefill:
        if req.g == 0:
            if req.group in held:
                continue
            held.add(req.group)
        tokens, rows = tokens + req.prompt + req.g - 1, rows + 1
    return tokens, rows


class ServerModel:
    """Every server's decode steps, joins, finishes and weight loads."""

    def __init__(
        self,
        events: EventQueue,
        cores: CoreModel,
        profile: Profile,
        n_servers: int,
        max_rows: int,
        interruptible: bool,
    ):
        self.events, self.cores, self.p = events, cores, profile
        self.servers = [_Server(slot=k, index=k) for k in range(n_servers)]
        self.max_rows = max_rows
        self.interruptible = interruptible
        self._seq = itertools.count()  # the order of requests finishing at one step
        self.on_generated: Callable[[_Group], None] = lambda group: None
        """A group's last sample finished."""
        self.on_loaded: Callable[[int], None] = lambda version: None
        """A server holds `version`."""
        self.generated = self.prefilled = self.interrupted = 0
        """Tokens decoded and prefilled, requests interrupted by an update."""

    # ---- requests ---------------------------------------------------------------------------
    def arrive(self, group: _Group) -> None:
        srv = self.servers[group.server]
        if srv.loading or srv.draining is not None:
            srv.held.extend(group.reqs)  # until the new weights are in
            return
        srv.queue.extend(group.reqs)
        if self.p.decode.group_s:
            self._stall(srv, self.p.decode.group_s)
        if srv.seg is not None:
            self._cut(srv)  # joins at the next step
        elif not srv.plan_pending:  # after every arrival of this instant (one first step)
            srv.plan_pending = True
            self.events.at(self.events.now, self._planned, srv)

    def retuned(self) -> None:
        """The cores changed: a server whose rate changed ends its run at the next step."""
        for srv in self.servers:
            rate = self.cores.rate(srv, self.p.decode.speedup)
            if srv.seg is not None and abs(rate - srv.seg.rate) > 1e-9:
                self._cut(srv)

    def _planned(self, srv: _Server) -> None:
        srv.plan_pending = False
        self._plan(srv)

    def _stall(self, srv: _Server, seconds: float) -> None:
        """The server's process spends `seconds` outside decode steps (a group's requests
        and responses over HTTP): its steps wait, the interpreter being one."""
        if srv.seg is not None:
            srv.seg.t0 += seconds
            self._schedule(srv)
        srv.stall_until = max(srv.stall_until, self.events.now) + seconds

    def _tokens(self, srv: _Server, req: _Req) -> int:
        return req.g + srv.clock - req.join_clock

    # ---- decode steps -----------------------------------------------------------------------
    def _plan(self, srv: _Server) -> None:
        """Start the next run of equal steps, or wait."""
        if srv.seg is not None or srv.loading:
            return
        now = self.events.now
        if now < srv.stall_until - 1e-12:  # still handling requests
            if not srv.plan_pending:
                srv.plan_pending = True
                self.events.at(srv.stall_until, self._planned, srv)
            return
        d = self.p.decode
        # While draining (a non-interruptible update) new arrivals are held back, but what
        # the server has queued already is admitted: the engine knows of no drain.
        while srv.queue and len(srv.running) < self.max_rows:
            req = srv.queue.pop(0)
            req.join_clock = srv.clock
            srv.running[req] = None
            heapq.heappush(srv.heap, (srv.clock + req.target - req.g, next(self._seq), req))
            if not req.cached:
                srv.prefill.append(req)
            if req.first_version is None:
                req.first_version = srv.version
        if not srv.running:
            self.cores.set_working(srv, False)
            if srv.draining is not None and not srv.queue:
                self._start_load(srv, srv.draining, now)
            return
        self.cores.set_working(srv, True)
        rows = len(srv.running)
        pf_tokens, pf_rows = _prefill_work(srv)
        rate = self.cores.rate(srv, d.speedup)
        srv.seg = _Segment(
            t0=now,
            rows=rows,
            cells=self.place(srv),
            prefill_s=(d.prefill_token_s * pf_tokens + d.prefill_row_s * pf_rows) / rate,
            per_step_s=(d.step_s + d.row_s * rows) / rate,
            cell_s=d.cell_s / rate,
            rate=rate,
            k=srv.heap[0][0] - srv.clock,  # until the first request finishes
            prefilled=pf_tokens,
        )
        self._schedule(srv)

    def place(self, srv: _Server) -> int:
        """Give the running requests their rows as DecodeEngine._place does (a request keeps
        its row, those above the kept count fill the leavers' holes, new ones follow longest
        first); returns the cells the next step reads (on a CPU, each chunk of rows up to its
        longest row)."""
        row = {r: i for i, r in enumerate(srv.rows) if r in srv.running}
        holes = iter(sorted(set(range(len(row))) - set(row.values())))
        order = [None] * len(row)
        for r, i in row.items():
            order[i if i < len(row) else next(holes)] = r
        new = [r for r in srv.running if r not in row]
        ctx = {r: r.prompt + self._tokens(srv, r) - 1 for r in srv.running}  # cached tokens
        srv.rows = order + sorted(new, key=lambda r: -ctx[r])
        lens = [ctx[r] for r in srv.rows]
        return cells_read(attention_chunks(lens)) if self.cores.cpu else sum(lens) + len(lens)

    def _schedule(self, srv: _Server) -> None:
        """(Re)schedule the end of the server's segment; an older end event goes stale."""
        srv.seg_id += 1
        end = max(self.events.now, srv.seg.t0 + srv.seg.time(srv.seg.k))
        self.events.at(end, self._seg_end, srv, srv.seg_id)

    def _cut(self, srv: _Server) -> None:
        """End the current run of steps at the next step boundary (a change applies there)."""
        seg = srv.seg
        k = min(seg.k, seg.steps_by(self.events.now - seg.t0) + 1)  # the step in flight ends
        if k < seg.k:
            seg.k = k
            self._schedule(srv)

    def _seg_end(self, srv: _Server, seg_id: int) -> None:
        if seg_id != srv.seg_id or srv.seg is None:
            return
        rows, k = srv.seg.rows, srv.seg.k
        self.prefilled += srv.seg.prefilled
        srv.seg = None
        srv.clock += k
        self.generated += rows * k
        for req in srv.prefill:
            req.cached = True
        srv.prefill.clear()
        while srv.heap and srv.heap[0][0] <= srv.clock:
            _, _, req = heapq.heappop(srv.heap)
            del srv.running[req]
            req.g = req.target
            group = req.group
            group.n_done += 1
            if group.n_done == len(group.reqs):
                self.on_generated(group)
        if srv.interrupt is not None:
            version, t_update = srv.interrupt
            srv.interrupt = None
            self._abort_all(srv)
            self.cores.set_working(srv, False)
            self._start_load(srv, version, t_update)
            return
        self._plan(srv)

    # ---- weight updates ---------------------------------------------------------------------
    def update(self, srv: _Server, version: int) -> None:
        """update_weights(version) reaches the server (areal/rollout/worker.py's paths)."""
        now = self.events.now
        in_flight = bool(srv.running or srv.queue)
        if in_flight and self.interruptible:
            srv.loading = True  # nothing is admitted from here on
            if srv.seg is not None:  # abort once the step in flight ends
                srv.interrupt = (version, now)
                self._cut(srv)
            else:
                self._abort_all(srv)
                self._start_load(srv, version, now)
        elif in_flight:  # the ablation: no new requests, the running ones finish first
            srv.draining = version
        else:
            self._start_load(srv, version, now)

    def _abort_all(self, srv: _Server) -> None:
        """Every request comes back with its partial output and is resubmitted at once; it
        waits for the new weights and is prefilled again (prompt + output so far)."""
        for req in list(srv.running):
            req.g = self._tokens(srv, req)
            req.cached = False
        self.interrupted += len(srv.running)
        srv.held = [*srv.running, *srv.queue, *srv.held]
        for req in srv.queue:
            req.cached = False
        srv.running.clear()
        srv.heap.clear()
        srv.queue.clear()
        srv.prefill.clear()
        srv.rows = []  # resubmitted: new requests to the engine

    def _start_load(self, srv: _Server, version: int, t_update: float) -> None:
        srv.loading = True
        # The load span covers the wait for the step in flight: it ends load_s after the
        # update arrived, or when that step ended if later.
        end = max(self.events.now, t_update + self.p.handoff.load_s)
        self.events.at(end, self._load_done, srv, version)

    def _load_done(self, srv: _Server, version: int) -> None:
        srv.version, srv.loading, srv.draining = version, False, None
        srv.queue.extend(srv.held)
        srv.held = []
        self.on_loaded(version)
        self._plan(srv)
