"""A discrete-event simulation of one run as areal runs it, on a profile's cost models.

    controller: StalenessGate + ReplayBuffer (areal/controller/, the very classes) admit a
        group whenever the gate has capacity; the router sends it to the server with the
        fewest groups in flight; a finished group waits for the trainer, oldest first
    server k:   continuous batching in decode steps; requests join between steps (up to
        inference.max_batch_size rows); a weight update aborts every request, waits for the
        step in flight, loads, and the resubmitted requests are prefilled again (prompt +
        output so far) under the new version
    trainer:    get_batch(i) -> step overhead -> proximal pass (minibatches 2..n) -> n
        minibatch updates (micro-batches by Algorithm 1) -> publish v(i+1) -> fan-out to
        every server (one version at a time) -> the gate moves to i+1
    cores (CPU profile): servers and the trainer split the node's cores; a role waiting
        BORROW_AFTER_S lends its share to those working (areal/cores.py's rule), and more
        threads than cores slow every working role in proportion

| event        | what it does                                                          |
|--------------|-----------------------------------------------------------------------|
| segment end  | a server's run of k equal decode steps ends: a request finished, or a |
|              | change (a join, a thread change, an update) cut it at a step boundary |
| arrive       | a group's requests reach its server (half the group overhead after    |
|              | admission), which spends decode.group_s on them outside its steps     |
| group done   | its last sample finished (+ half the overhead): the gate, the buffer  |
| load done    | a server holds the new version; the last one moves the gate           |
| phase end    | the trainer finished a phase of its step (a rate change reschedules)  |
| lend         | a role has waited BORROW_AFTER_S: its share goes to the working roles |

A server's steps between two changes have equal rows, and each step adds one token to every
row, so k steps cost k * (step_s + row_s * rows) + cell_s * (k * cells + rows * k(k-1)/2)
at once: an event per join, finish or update, never one per decode step. A request's
first token carries the server's version then (its staleness at training is the trainer's
version minus that one, as areal.trainer.worker.staleness counts it).

Left out: the reward's grading time beyond a constant per group, failures and restarts,
checkpoints, the KV budget's finer rules (SGLang's retraction), dynamic sampling's dropped
groups, agent workflows, data-parallel collectives' skew, and the noise of a shared machine.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from areal.config import ConfigError, ExperimentConfig
from areal.controller.buffer import ReplayBuffer
from areal.controller.staleness import StalenessGate
from areal.cores import BORROW_AFTER_S
from areal.planner.costs import Profile, micro_batch_count, speed
from areal.rollout.chunks import attention_chunks, cells_read


@dataclass
class Setting:
    """What one simulated run is: the config's knobs that shape its timeline."""

    batch_size: int
    """Groups a training step takes (trainer.batch_size)."""
    group_size: int
    eta: int
    max_concurrent: int = 0
    """Groups in flight at most; 0 = one batch (StalenessGate's rule)."""
    n_minibatches: int = 4
    max_tokens_per_mb: int = 8192
    max_new_tokens: int = 512
    n_servers: int = 1
    max_rows: int = 128
    interruptible: bool = True
    lend: bool = True
    trainer_devices: int = 1
    """GPUs of the trainer (data parallel: token costs divide by it); 1 on a CPU."""
    steps: int = 40
    seed: int = 1

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, **overrides) -> Setting:
        values = dict(
            batch_size=cfg.trainer.batch_size,
            group_size=cfg.rollout.group_size,
            eta=cfg.max_staleness,
            max_concurrent=cfg.rollout.max_concurrent,
            n_minibatches=cfg.ppo.n_minibatches,
            max_tokens_per_mb=cfg.trainer.mb_spec.max_tokens_per_mb,
            max_new_tokens=cfg.rollout.max_new_tokens,
            n_servers=cfg.rollout.n_servers,
            max_rows=cfg.inference.max_batch_size,
            interruptible=cfg.rollout.interruptible,
            lend=cfg.launcher.lend_idle_cores,
            steps=cfg.total_train_steps,
            seed=cfg.seed,
        )
        values.update(overrides)
        return cls(**values)


@dataclass
class Result:
    throughput: float
    """Effective training throughput: tokens trained per second after the first fifth."""
    staleness_mean: float
    staleness_max: int
    staleness_hist: dict[int, int]
    idle: dict[str, float]
    """Share of the measured window each role did not compute (servers: not decoding)."""
    held_by_eta: float
    """Share of the window in which the staleness bound kept the gate shut."""
    step_times: list[float]
    bottleneck: str
    generated: int = 0
    prefilled: int = 0
    interrupted: int = 0
    trajectories_per_s: float = 0.0
    """Trajectories trained per second, over the same window as throughput."""
    controller_cores: float | None = None
    """The share of its one core the controller needs at this pace (None: not measured);
    over 1, the controller sets the pace and throughput is cut to what it sustains."""


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


# ---- the simulated parts ----------------------------------------------------------------------


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
class _Role:
    """A computing role's place in the cores ledger."""

    slot: int
    working: bool = False
    waiting_since: float | None = 0.0
    """Since when it waits (the ledger's slot); None while it works."""
    threads: int = 1
    busy: list[tuple[float, float]] = field(default_factory=list)
    busy_since: float | None = None


@dataclass(eq=False)
class _Server(_Role):
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


class Simulation:
    def __init__(self, profile: Profile, setting: Setting):
        if setting.n_servers < 1 or setting.batch_size < 1 or setting.group_size < 1:
            raise ConfigError("the planner needs at least one server, one group and one sample")
        self.p, self.s = profile, setting
        self.rng = random.Random(setting.seed)
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.cpu = profile.device == "cpu"
        self.servers = [_Server(slot=k, index=k) for k in range(setting.n_servers)]
        self.trainer = _Trainer(slot=setting.n_servers)
        self.roles: list[_Role] = [*self.servers, self.trainer]
        # Cores (areal/cores.py): each computing role's share, and the node's limit.
        self.cores = profile.cores if self.cpu else 0
        self.share = max(1, self.cores // len(self.roles)) if self.cpu else 1
        self.limit = max(self.share, self.cores)
        self.gate = StalenessGate(setting.batch_size, setting.eta, setting.max_concurrent)
        self.buffer = ReplayBuffer()
        self.load = [0] * setting.n_servers
        self.pending_versions: list[int] = []
        self.fanning = False
        self.loaded = 0
        self.prompt = max(1, round(profile.lengths.prompt_len))
        max_len = self.prompt + setting.max_new_tokens
        rows = setting.max_rows
        if profile.kv_budget:  # the engine's rule: rows x the longest request's max length
            rows = min(rows, max(1, profile.kv_budget // max_len))
        self.max_rows = rows
        self.records: list[dict] = []
        self.staleness: list[list[int]] = []
        self.held: list[tuple[float, float]] = []
        self._held_since: float | None = None
        self.capped: list[tuple[float, float]] = []
        self._capped_since: float | None = None
        self.generated = self.prefilled = self.interrupted = 0

    # ---- the event loop -------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> Result:
        for role in self.roles:  # every role starts waiting: servers for requests, the
            role.threads = self.share  # trainer for its first batch
            self.at(BORROW_AFTER_S, self._lend, role, 0.0)
        self._admit()
        self._request_batch()
        budget = 50_000_000  # events: a deadline for a run that could never finish
        while self._events and self.trainer.version < self.s.steps:
            t, _, fn, args = heapq.heappop(self._events)
            self.now = t
            fn(*args)
            budget -= 1
            if budget == 0:
                raise RuntimeError("the simulation did not finish (an internal error)")
        if self.trainer.version < self.s.steps:
            raise RuntimeError(
                f"the simulated run stopped at step {self.trainer.version}: nothing left to "
                "happen (an internal error: the gate, buffer and trainer disagree)"
            )
        return self._result()

    # ---- cores ----------------------------------------------------------------------------
    def _set_working(self, role: _Role, working: bool) -> None:
        if role.working == working:
            return
        role.working = working
        if working:
            role.waiting_since = None
            role.busy_since = self.now
        else:
            role.waiting_since = self.now
            role.busy.append((role.busy_since, self.now))
            role.busy_since = None
            if self.cpu and self.s.lend:
                self.at(self.now + BORROW_AFTER_S, self._lend, role, self.now)
        self._retune()

    def _lend(self, role: _Role, since: float) -> None:
        if role.waiting_since == since:
            self._retune()

    def _threads(self, role: _Role) -> int:
        if not self.cpu or not self.s.lend:
            return self.share
        # Cores.adapt: the cores beside the holders' shares go to the holders in equal parts.
        lent_before = self.now - BORROW_AFTER_S + 1e-12
        holders = [
            r.slot
            for r in self.roles
            if r is role or r.waiting_since is None or r.waiting_since > lent_before
        ]
        extra, rest = divmod(max(0, self.limit - self.share * len(holders)), len(holders))
        extra += sorted(holders).index(role.slot) < rest
        return self.share + extra

    def _rate(self, role: _Role, speedup: dict[int, float]) -> float:
        if not self.cpu:
            return 1.0
        busy = sum(r.threads for r in self.roles if r.working)
        contention = min(1.0, self.cores / busy) if busy else 1.0
        return speed(speedup, role.threads) * contention

    def _retune(self) -> None:
        """Threads and rates after a change of who works: a server takes them at its next
        step, the trainer at its next layer (at once, here)."""
        if not self.cpu:
            return
        for role in self.roles:
            role.threads = self._threads(role)
        for srv in self.servers:
            rate = self._rate(srv, self.p.decode.speedup)
            if srv.seg is not None and abs(rate - srv.seg.rate) > 1e-9:
                self._cut(srv)
        t = self.trainer
        if t.working and t.phases is not None:
            self._trainer_rate()

    # ---- controller -----------------------------------------------------------------------
    def _admit(self) -> None:
        while self.gate.capacity() > 0:
            start_version = self.gate.on_rollout_submitted()
            gid = self.buffer.reserve(start_version)
            k = min(range(len(self.load)), key=lambda i: self.load[i])  # router.pick
            self.load[k] += 1
            group = _Group(gid, start_version, k)
            lengths = self.p.lengths.sample(self.rng, self.s.group_size, self.s.max_new_tokens)
            group.reqs = [_Req(self.prompt, n, group) for n in lengths]
            self.at(self.now + self.p.group_overhead_s / 2, self._arrive, group)
        self._track_held()

    def _track_held(self) -> None:
        """Intervals in which the gate is shut by eta, and by the cap on groups in flight."""
        g = self.gate
        by_eta = g.batch_size * (g.version + g.max_staleness + 1) - g.n_started <= 0
        by_cap = not by_eta and g.max_concurrent - g.n_running <= 0
        for shut, intervals, attr in ((by_eta, self.held, "_held_since"),
                                      (by_cap, self.capped, "_capped_since")):  # fmt: skip
            since = getattr(self, attr)
            if shut and since is None:
                setattr(self, attr, self.now)
            elif not shut and since is not None:
                intervals.append((since, self.now))
                setattr(self, attr, None)

    def _group_done(self, group: _Group) -> None:
        self.gate.on_rollout_accepted()
        self.buffer.put(group.gid, group.reqs)
        self._give_batch()
        self._admit()

    def _weights_ready(self, version: int) -> None:
        self.pending_versions.append(version)
        self._fan_out()

    def _fan_out(self) -> None:
        """One version at a time (the controller's update lock), to every server."""
        if self.fanning or not self.pending_versions:
            return
        version = self.pending_versions.pop(0)
        self.fanning, self.loaded = True, 0
        for srv in self.servers:
            self._update(srv, version)

    def _server_loaded(self, version: int) -> None:
        self.loaded += 1
        if self.loaded == len(self.servers):
            self.at(self.now + self.p.handoff.fanout_s, self._version_done, version)

    def _version_done(self, version: int) -> None:
        self.gate.on_version(version)
        self.fanning = False
        self._admit()
        self._fan_out()

    # ---- servers --------------------------------------------------------------------------
    def _arrive(self, group: _Group) -> None:
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
            self.at(self.now, self._planned, srv)

    def _planned(self, srv: _Server) -> None:
        srv.plan_pending = False
        self._plan(srv)

    def _stall(self, srv: _Server, seconds: float) -> None:
        """The server's process spends `seconds` outside decode steps (a group's requests
        and responses over HTTP): its steps wait, the interpreter being one."""
        if srv.seg is not None:
            srv.seg.t0 += seconds
            self._schedule(srv)
        srv.stall_until = max(srv.stall_until, self.now) + seconds

    def _tokens(self, srv: _Server, req: _Req) -> int:
        return req.g + srv.clock - req.join_clock

    def _plan(self, srv: _Server) -> None:
        """Start the next run of equal steps, or wait."""
        if srv.seg is not None or srv.loading:
            return
        if self.now < srv.stall_until - 1e-12:  # still handling requests
            if not srv.plan_pending:
                srv.plan_pending = True
                self.at(srv.stall_until, self._planned, srv)
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
            self._set_working(srv, False)
            if srv.draining is not None and not srv.queue:
                self._start_load(srv, srv.draining, self.now)
            return
        self._set_working(srv, True)
        rows = len(srv.running)
        pf_tokens, pf_rows = _prefill_work(srv)
        rate = self._rate(srv, d.speedup)
        srv.seg = _Segment(
            t0=self.now,
            rows=rows,
            cells=self._place(srv),
            prefill_s=(d.prefill_token_s * pf_tokens + d.prefill_row_s * pf_rows) / rate,
            per_step_s=(d.step_s + d.row_s * rows) / rate,
            cell_s=d.cell_s / rate,
            rate=rate,
            k=srv.heap[0][0] - srv.clock,  # until the first request finishes
            prefilled=pf_tokens,
        )
        self._schedule(srv)

    def _place(self, srv: _Server) -> int:
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
        return cells_read(attention_chunks(lens)) if self.cpu else sum(lens) + len(lens)

    def _schedule(self, srv: _Server) -> None:
        """(Re)schedule the end of the server's segment; an older end event goes stale."""
        srv.seg_id += 1
        end = max(self.now, srv.seg.t0 + srv.seg.time(srv.seg.k))
        self.at(end, self._seg_end, srv, srv.seg_id)

    def _cut(self, srv: _Server) -> None:
        """End the current run of steps at the next step boundary (a change applies there)."""
        seg = srv.seg
        k = min(seg.k, seg.steps_by(self.now - seg.t0) + 1)  # the step in flight completes
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
                self.load[group.server] -= 1
                self.at(self.now + self.p.group_overhead_s / 2, self._group_done, group)
        if srv.interrupt is not None:
            version, t_update = srv.interrupt
            srv.interrupt = None
            self._abort_all(srv)
            self._set_working(srv, False)
            self._start_load(srv, version, t_update)
            return
        self._plan(srv)

    def _update(self, srv: _Server, version: int) -> None:
        """update_weights(version) reaches the server (areal/rollout/worker.py's paths)."""
        in_flight = bool(srv.running or srv.queue)
        if in_flight and self.s.interruptible:
            srv.loading = True  # nothing is admitted from here on
            if srv.seg is not None:  # abort once the step in flight ends
                srv.interrupt = (version, self.now)
                self._cut(srv)
            else:
                self._abort_all(srv)
                self._start_load(srv, version, self.now)
        elif in_flight:  # the ablation: no new requests, the running ones finish first
            srv.draining = version
        else:
            self._start_load(srv, version, self.now)

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
        end = max(self.now, t_update + self.p.handoff.load_s)
        self.at(end, self._load_done, srv, version)

    def _load_done(self, srv: _Server, version: int) -> None:
        srv.version, srv.loading, srv.draining = version, False, None
        srv.queue.extend(srv.held)
        srv.held = []
        self._server_loaded(version)
        self._plan(srv)

    # ---- trainer --------------------------------------------------------------------------
    def _request_batch(self) -> None:
        t = self.trainer
        self._set_working(t, False)
        t.wants_batch = True
        self._give_batch()

    def _give_batch(self) -> None:
        t = self.trainer
        if not t.wants_batch:
            return
        groups = self.buffer.take(t.version, self.s.batch_size, self.s.eta)
        if groups is None:
            return
        t.wants_batch = False
        self.at(self.now + self.p.train.rpc_s, self._train, groups)

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
        self._set_working(t, True)
        self._next_phase()

    def _next_phase(self) -> None:
        t = self.trainer
        if not t.phases:
            self._step_done()
            return
        work, t.threaded = t.phases.pop(0)
        t.remaining, t.phase_since = work, self.now
        t.rate = self._phase_rate()
        t.job_id += 1
        self.at(self.now + work / t.rate, self._phase_end, t.job_id)

    def _phase_rate(self) -> float:
        t = self.trainer
        rate = self._rate(t, self.p.train.speedup if t.threaded else {1: 1.0})
        return max(rate, 1e-9)

    def _trainer_rate(self) -> None:
        t = self.trainer
        rate = self._phase_rate()
        if abs(rate - t.rate) < 1e-12:
            return
        t.remaining = max(0.0, t.remaining - (self.now - t.phase_since) * t.rate)
        t.rate, t.phase_since = rate, self.now
        t.job_id += 1
        self.at(self.now + t.remaining / rate, self._phase_end, t.job_id)

    def _phase_end(self, job_id: int) -> None:
        if job_id == self.trainer.job_id:
            self._next_phase()

    def _step_done(self) -> None:
        t = self.trainer
        t.version += 1
        tokens = sum(r.target for r in t.batch)
        self.records.append(
            {"step": t.version, "time": self.now, "train/n_tokens": tokens, "seqs": len(t.batch)}
        )
        t.batch = None
        self._weights_ready(t.version)
        if t.version < self.s.steps:
            self._request_batch()

    # ---- the figures ----------------------------------------------------------------------
    def _result(self) -> Result:
        recs = self.records
        warm = len(recs) // 5
        t0, t1 = recs[warm]["time"], recs[-1]["time"]
        stale = [x for step in self.staleness[warm + 1 :] for x in step] or [0]
        hist: dict[int, int] = {}
        for x in stale:
            hist[x] = hist.get(x, 0) + 1

        def busy_share(role: _Role) -> float:
            spans = list(role.busy)
            if role.busy_since is not None:
                spans.append((role.busy_since, self.now))
            return _overlap(spans, t0, t1) / max(t1 - t0, 1e-12)

        idle = {f"server{s.index}": 1 - busy_share(s) for s in self.servers}
        idle["trainer0"] = 1 - busy_share(self.trainer)
        held = list(self.held)
        if self._held_since is not None:
            held.append((self._held_since, self.now))
        # Held by eta: a server idle while the bound keeps the gate shut (mean over servers).
        capped = list(self.capped)
        if self._capped_since is not None:
            capped.append((self._capped_since, self.now))
        capped_share = _overlap(capped, t0, t1) / max(t1 - t0, 1e-12)
        held_share = sum(
            _overlap(held, t0, t1) - _overlap_pairs(held, _busy(s, self.now), t0, t1)
            for s in self.servers
        ) / (len(self.servers) * max(t1 - t0, 1e-12))
        return Result(
            throughput=effective_throughput(recs),
            trajectories_per_s=effective_throughput(recs, "seqs"),
            staleness_mean=sum(stale) / len(stale),
            staleness_max=max(stale),
            staleness_hist=dict(sorted(hist.items())),
            idle=idle,
            held_by_eta=held_share,
            step_times=[r["time"] for r in recs],
            bottleneck=bottleneck(idle, held_share, self.s.eta, capped_share),
            generated=self.generated,
            prefilled=self.prefilled,
            interrupted=self.interrupted,
        )


def _overlap(spans: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Time the (disjoint) spans cover within [t0, t1]."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)


def _overlap_pairs(xs: list, ys: list, t0: float, t1: float) -> float:
    """Time within [t0, t1] covered by both of two lists of disjoint spans."""
    xs, ys = sorted(xs), sorted(ys)
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):  # two sorted lists, walked together
        a, b = max(xs[i][0], ys[j][0], t0), min(xs[i][1], ys[j][1], t1)
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def _busy(role: _Role, now: float) -> list[tuple[float, float]]:
    return role.busy + ([(role.busy_since, now)] if role.busy_since is not None else [])


def effective_throughput(records: list[dict], key: str = "train/n_tokens") -> float:
    """benchmarks/tiny_run.effective_throughput, here so the planner imports no benchmark:
    tokens (or another count of a step's) trained per second, the first fifth of the steps
    (warm-up) left out."""
    warm = len(records) // 5
    total = sum(x[key] for x in records[warm + 1 :])
    return total / max(records[-1]["time"] - records[warm]["time"], 1e-12)


def bottleneck(idle: dict[str, float], held: float, eta: int, capped: float = 0.0) -> str:
    """Which role sets the pace, in words: the one that never waits."""
    trainer = idle["trainer0"]
    servers = [v for k, v in idle.items() if k.startswith("server")]
    server = sum(servers) / len(servers)
    if trainer < 0.1 and trainer <= server:
        return "trainer (it never waits; the servers are held by eta or idle)"
    if server < 0.1:
        if capped > 0.5:
            return (
                "generation (the trainer waits; rollout.max_concurrent caps the groups in flight)"
            )
        return "generation (the servers never wait; the trainer waits for batches)"
    if eta == 0:
        return "synchronous: the roles take turns (eta=0)"
    if held > 0.5 * server:
        return "the staleness bound (servers held by eta while the trainer waits too)"
    return "hand-off and overheads (both roles wait)"


def simulate(profile: Profile, setting: Setting) -> Result:
    return Simulation(profile, setting).run()
