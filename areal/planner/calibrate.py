"""Fit a CPU profile's cost models from the timelines of short profiling runs (one, or several
pooled: the config as it is, and the same at max_staleness=0 for the speed-up of lent cores).

    events/server*.jsonl   decode windows: seconds ~ steps, rows, cells read, prefill, prefill rows
                           (by threads); load spans -> load_s
    events/trainer*.jsonl  update spans: seconds ~ tokens, seqs, (micro-batches); proximal
                           spans likewise; borrow spans -> which of them ran on lent cores;
                           publish -> publish_s; what lies between the spans -> step_s
    events/controller0     update_weights beyond the slowest load -> fanout_s; its CPU
                           samples over the trajectories trained -> controller[data plane]
    batches.jsonl          output lengths, by group (group_size consecutive samples)

Least squares with coefficients kept >= 0 (a cost is never negative: a column whose
coefficient would be is dropped and the rest refitted). Each run counts from the end of its
first fifth of steps (start-up and first allocations left out, as the benchmarks leave them
out of throughput), and at the median pace of the runs: a run whose spans took longer than
the pooled fit says, all of them alike (other work on the machine), is scaled to the median
before the fit is redone, so that one slow run among three moves no cost (_even_paces; each
run's pace is printed). A server's speed-up on n threads is
the one-thread fit's prediction over the measured time, summed over its windows on n threads;
the trainer's, from the spans it ran partly on a lent core (_lent_speedup).
Run it on a run of the configuration you plan (its lengths and batch shapes), with
stats.events on (the default) and the embedded engine (SGLang records no decode windows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from areal.config import ConfigError
from areal.cores import node_cores
from areal.planner.costs import DecodeCost, Handoff, Lengths, Profile, TrainCost
from areal.report.data import NotARunError, Run, cores_used, load_run

MIN_SPANS = 8
"""Fewer spans than this of a kind fit nothing reliably: the run was too short."""
MIN_LENT_S = 0.5
"""Seconds of lent cores under a role's spans that a speed-up is fitted from, at least."""
WARMUP_FRACTION = 0.2
"""The share of a run's first steps left out of its costs."""
PACE_WARN = 0.15
"""A run whose pace is this far from the runs' median is named in a warning."""
DEFAULT_GROUP_OVERHEAD_S = 0.004
"""Admission to server and last sample to buffer, when the run shows no idle server to
measure it on (controller + rollout worker + grading of a tiny task: a few ms)."""


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative and refit."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        del active[int(np.argmin(sol))]
    return coef


def _r2(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> float:
    resid = y - x @ coef
    total = ((y - y.mean()) ** 2).sum()
    return float(1 - (resid**2).sum() / total) if total > 0 else 1.0


def _even_paces(
    rows: list[tuple[int, bool, np.ndarray, float]],
    runs: list[Run],
    what: str,
    notes: list[str],
    fit: Callable[[np.ndarray, np.ndarray], np.ndarray] = nnls,
) -> tuple[np.ndarray, list[tuple[int, bool, np.ndarray, float]]]:
    """The fit over the base rows (run index, on base threads, features, seconds), with every
    run's seconds scaled to the median of the runs' paces (measured / pooled prediction over
    its base rows), and the rows so scaled. A run with too few base rows to pace keeps its
    seconds; with one run to pace, nothing changes."""

    def base_fit(rs: list[tuple[int, bool, np.ndarray, float]]) -> np.ndarray:
        return fit(np.array([x for _, b, x, _ in rs if b]), np.array([y for _, b, _, y in rs if b]))

    coef = base_fit(rows)
    paces: dict[int, float] = {}
    for i in range(len(runs)):
        mine = [(x, y) for r, b, x, y in rows if r == i and b]
        predicted = sum(float(x @ coef) for x, _ in mine)
        if len(mine) >= MIN_SPANS and predicted > 0:
            paces[i] = sum(y for _, y in mine) / predicted
    if len(paces) < 2:
        return coef, rows
    mid = float(np.median(list(paces.values())))
    notes.append(
        f"{what}: each run's time against the median run's for the same work: "
        + ", ".join(f"{runs[i].path.name} {p / mid:.2f}x" for i, p in paces.items())
        + "; each counted at the median"
    )
    for i, p in paces.items():
        if abs(p / mid - 1) > PACE_WARN:
            notes.append(
                f"{WARNING}{runs[i].path} took {p / mid:.2f}x the median run's time for its {what} "
                "work: the machine was likely busy with other work; it counts at the median "
                "(profile three runs or more, so that the median is a run's)"
            )
    rows = [(r, b, x, y * mid / paces.get(r, mid)) for r, b, x, y in rows]
    return base_fit(rows), rows


def _steady(run: Run) -> Run:
    """The run from the end of its first fifth of steps (the publish that ends it) on."""
    ends = sorted(e["end"] for e in _spans(run, "trainer0", "publish"))
    if len(ends) < 10:
        return run
    start = ends[int(WARMUP_FRACTION * len(ends)) - 1]
    return dataclasses.replace(run, events=[e for e in run.events if e["start"] >= start])


def _spans(run: Run, role_prefix: str, kind: str) -> list[dict]:
    return [e for e in run.events if e["role"].startswith(role_prefix) and e["kind"] == kind]


def _borrowed(span: dict, borrows: list[dict]) -> float:
    """Mean extra shares the span ran on (the role's borrow spans overlapping it)."""
    dur = span["end"] - span["start"]
    if dur <= 0:
        return 0.0
    lent = sum(
        b.get("lent", 1) * max(0.0, min(b["end"], span["end"]) - max(b["start"], span["start"]))
        for b in borrows
    )
    return lent / dur


def _speedups(
    rows: list[tuple[int, np.ndarray, float]], coef: np.ndarray, notes: list[str], what: str
) -> dict[int, float]:
    """{threads: one-thread prediction / measured} over the spans on each thread count."""
    out = {1: 1.0}
    for n in sorted({t for t, _, _ in rows if t > 1}):
        xs = [(x, y) for t, x, y in rows if t == n]
        measured = sum(y for _, y in xs)
        if len(xs) < MIN_SPANS or measured <= 0:  # a few spans' noise is no speed-up
            continue
        # Within what n threads can do: below half of one thread is noise or a machine busy
        # with something else, not threads.
        raw = float(sum(x @ coef for x, _ in xs) / measured)
        out[n] = min(float(n), max(0.5, raw))
        notes.append(f"{what} on {n} threads: {out[n]:.2f}x one thread ({len(xs)} spans)")
        _check_speedup(raw, n, what, notes)
    if len(out) == 1:
        notes.append(f"{what}: no span on lent cores; a second thread assumed to add nothing")
    return out


R2_WARN = 0.8
"""A fit explaining less of its spans' variance than this predicts poorly: say so."""
WARNING = "warning: "
"""The start of a note that the planner prints as a warning."""


def _check_fit(r2: float, what: str, notes: list[str]) -> None:
    if r2 < R2_WARN:
        notes.append(
            f"{WARNING}the {what} fit's R^2 is {r2:.2f} (under {R2_WARN}): its costs, and the "
            "plan made of them, are rough; profile a longer run (more steps) on an otherwise "
            "idle machine"
        )


def _check_speedup(raw: float, n: int, what: str, notes: list[str]) -> None:
    """A lent thread that slows a role down, or speeds it past n threads, is a measurement
    of something else (other work on the machine, too few spans), not of the thread."""
    if raw < 1.0 or raw > n:
        notes.append(
            f"{WARNING}{what} on {n} threads measured {raw:.2f}x one thread (taken as "
            f"{min(float(n), max(0.5, raw)):.2f}x): threads cannot do that; the machine was "
            "likely busy with other work while profiling, so treat lent cores' gains as unknown"
        )


def _where(runs: list[Run]) -> str:
    return " + ".join(str(run.path) for run in runs)


def fit_decode(runs: list[Run], notes: list[str]) -> DecodeCost:
    group_s = _group_s(runs, notes)  # whole runs: their generate spans against their batches
    runs = [_steady(run) for run in runs]
    indexed = [(i, w) for i, run in enumerate(runs) for w in _spans(run, "server", "decode")]
    windows = [w for _, w in indexed]
    if len(windows) < MIN_SPANS:
        raise ConfigError(
            f"{_where(runs)} has {len(windows)} decode windows (events/server*.jsonl, kind "
            "'decode'); the fit needs at least "
            f"{MIN_SPANS}. Profile a run of the embedded engine (inference.backend=embedded) "
            "with stats.events=true and at least 20 steps, made by this version of areal"
        )
    # `read`: the cells attention read (chunks of rows up to their longest), which is what a
    # step costs; runs recorded before it was measured give the contexts' sum instead.
    cells = "read" if all("read" in w for w in windows) else "cells"
    cols = ("steps", "rows", cells, "prefill", "prefill_rows")
    threads = [int(w.get("threads", 1)) for w in windows]
    base = min(threads)
    rows = [
        (i, t == base, np.array([w[c] for c in cols], float), w["end"] - w["start"])
        for (i, w), t in zip(indexed, threads, strict=True)
    ]
    coef, rows = _even_paces(rows, runs, "decode", notes)
    x = np.array([xx for _, b, xx, _ in rows if b])
    y = np.array([yy for _, b, _, yy in rows if b])
    r2 = _r2(x, y, coef)
    notes.append(f"decode fit over {len(y)} windows on {base} thread(s): R^2 {r2:.3f}")
    _check_fit(r2, "decode", notes)
    timed = [(t, xx, yy) for t, (_, _, xx, yy) in zip(threads, rows, strict=True)]
    speedup = _speedups(timed, coef, notes, "decode")
    if base != 1:  # the fit is of `base` threads; express it against one
        notes.append(f"decode: no one-thread window; costs are of {base} threads")
    return DecodeCost(*map(float, coef), speedup=speedup, group_s=group_s)


def _group_s(runs: list[Run], notes: list[str]) -> float:
    """Server time per group outside decode steps: the servers' generate spans (requests in
    flight) less their decode windows, over the groups generated."""
    windows = [w for run in runs for w in _spans(run, "server", "decode")]
    generating = sum(e["end"] - e["start"] for r in runs for e in _spans(r, "server", "generate"))
    stepping = sum(w["end"] - w["start"] for w in windows)
    groups = sum(sum(len(b["output_len"]) for b in r.batches) / _group_size(r) for r in runs)
    if not generating or not groups:
        notes.append("decode: no generate spans; no server time outside decode steps assumed")
        return 0.0
    value = max(0.0, generating - stepping) / groups
    notes.append(
        f"decode: {100 * stepping / generating:.0f}% of the servers' generate spans are decode "
        f"steps; the rest is {1000 * value:.2f} ms a group"
    )
    return value


def fit_train(runs: list[Run], notes: list[str]) -> TrainCost:
    step_s, rpc_s = _trainer_gaps(runs)
    runs = [_steady(run) for run in runs]

    def work(kind: str) -> list[tuple[int, dict, float]]:
        """Rank 0's spans of `kind` that carry their work: (run index, span, cores lent)."""
        out = []
        for i, run in enumerate(runs):
            borrows = _spans(run, "trainer0", "borrow")
            spans = [s for s in _spans(run, "trainer0", kind) if "tokens" in s]
            out += [(i, s, _borrowed(s, borrows)) for s in spans]
        return out

    updates = work("update")
    if len(updates) < MIN_SPANS:
        raise ConfigError(
            f"{_where(runs)} has {len(updates)} update spans with their work (tokens, seqs, mbs) "
            f"in events/trainer0.jsonl; the fit needs at least {MIN_SPANS}: profile a run of "
            "at least 20 steps made by this version of areal, with stats.events=true"
        )

    def fit(spans: list[tuple[int, dict, float]], cols: tuple[str, ...], what: str):
        # The base rows: spans (nearly) on the trainer's own share.
        rows = [
            (i, lent < 0.2, np.array([s.get(c, 1) if c != "one" else 1 for c in cols], float),
             s["end"] - s["start"])
            for i, s, lent in spans
        ]  # fmt: skip
        if sum(b for _, b, _, _ in rows) < MIN_SPANS:  # everything on lent cores: fit all
            rows = [(i, True, x, y) for i, _, x, y in rows]
            notes.append(f"{what}: too few one-thread spans; fitted over all of them")
        # A column that never varies (a minibatch's sequences, with a fixed batch) is the
        # constant's: fitting both would split one cost between them at random.
        base_x = np.array([x for _, b, x, _ in rows if b])
        keep = [j for j, c in enumerate(cols) if c == "one" or base_x[:, j].std() > 0]

        def solve(x: np.ndarray, y: np.ndarray) -> np.ndarray:
            coef = np.zeros(len(cols))
            coef[keep] = nnls(x[:, keep], y)
            return coef

        coef, rows = _even_paces(rows, runs, what, notes, fit=solve)
        x = np.array([xx for _, b, xx, _ in rows if b])
        y = np.array([yy for _, b, _, yy in rows if b])
        r2 = _r2(x, y, coef)
        notes.append(f"{what} fit over {len(y)} spans: R^2 {r2:.3f}")
        _check_fit(r2, what, notes)
        dropped = [c for j, c in enumerate(cols) if j not in keep]
        if dropped:
            notes.append(f"{what}: {', '.join(dropped)} never varied; counted in the constant")
        lent = [e for _, _, e in spans]
        return coef, [(xx @ coef, t, e) for (_, _, xx, t), e in zip(rows, lent, strict=True)]

    # Micro-batches add a column only where their count varies (else it is the constant).
    varies = len({s.get("mbs", 1) for _, s, _ in updates}) > 1
    cols = ("tokens", "seqs", "mbs", "one") if varies else ("tokens", "seqs", "one")
    coef, lent = fit(updates, cols, "update")
    token_s, seq_s = coef[0], coef[1]
    mb_s = coef[2] if varies else 0.0
    minibatch_s = coef[-1]
    prox = work("proximal")
    if len(prox) >= MIN_SPANS:
        pc, prox_lent = fit(prox, ("tokens", "seqs", "one"), "proximal")
        lent += prox_lent
    else:
        pc = np.array([token_s / 3, seq_s / 3, 0.0])
        notes.append("proximal: too few spans; a third of an update's costs assumed")
    return TrainCost(
        token_s=float(token_s),
        seq_s=float(seq_s),
        mb_s=float(mb_s),
        minibatch_s=float(minibatch_s),
        prox_token_s=float(pc[0]),
        prox_seq_s=float(pc[1]),
        prox_const_s=float(pc[2]),
        step_s=step_s,
        rpc_s=rpc_s,
        speedup=_lent_speedup(lent, notes),
    )


def _lent_speedup(spans: list[tuple[float, float, float]], notes: list[str]) -> dict[int, float]:
    """The trainer on two threads (its core and a lent one) against one, from its spans
    (one-thread prediction P, measured T, mean cores lent e) that ran partly on a lent core:
    such a span did P = T (1 - e) + T e s, so s = 1 + sum(P - T) / sum(T e). A trainer lends
    and borrows core by core within its spans, so whole spans on two threads are rare."""
    lent = [(p, t, min(e, 1.0)) for p, t, e in spans if e > 0.05]
    weight = sum(t * e for _, t, e in lent)
    if weight < MIN_LENT_S:
        notes.append(
            f"trainer: {weight:.2f} s on lent cores (under {MIN_LENT_S} s); a second thread "
            "assumed to add nothing"
        )
        return {1: 1.0}
    # Within what two threads can do: below half of one is noise or a machine busy elsewhere.
    raw = 1 + sum(p - t for p, t, _ in lent) / weight
    s = min(2.0, max(0.5, raw))
    notes.append(
        f"trainer on 2 threads: {s:.2f}x one thread ({weight:.2f} s lent, {len(lent)} spans)"
    )
    _check_speedup(raw, 2, "trainer", notes)
    return {1: 1.0, 2: s}


def _trainer_gaps(runs: list[Run]) -> tuple[float, float]:
    """(median seconds of a step outside its spans, the shortest get_batch)."""
    gaps, sure, later_waits = [], [], []
    for run in runs:
        spans = [e for e in run.events if e["role"] == "trainer0" and e["kind"] != "borrow"]
        waits = [e for e in spans if e["kind"] == "wait_batch"]
        for a, b in zip(waits, waits[1:], strict=False):
            inside = sum(
                e["end"] - e["start"]
                for e in spans
                if e["kind"] not in ("wait_batch",) and a["end"] <= e["start"] < b["start"]
            )
            gaps.append(b["start"] - a["end"] - inside)
        # get_batch's own cost: the waits of the steps that found a batch ready (a whole
        # batch more still ready after it: metrics' rollout/groups_ready).
        batch = int((run.config.get("trainer") or {}).get("batch_size", 0)) or 1
        ready = {m["step"] - 1 for m in run.metrics if m.get("rollout/groups_ready", 0) >= batch}
        sure += [e["end"] - e["start"] for e in waits[1:] if e.get("version") in ready]
        later_waits += [e["end"] - e["start"] for e in waits[1:]]
    step_s = float(np.median(gaps)) if gaps else 0.0
    if len(sure) >= 3:
        rpc_s = float(np.median(sure))
    else:  # no step found its batch ready: the shortest wait
        rpc_s = min(later_waits, default=0.0)
    return max(0.0, step_s), max(0.0, rpc_s)


def fit_handoff(runs: list[Run]) -> Handoff:
    publish = [e["end"] - e["start"] for r in runs for e in _spans(r, "trainer0", "publish")]
    loads = [e for r in runs for e in _spans(r, "server", "load")]
    if not publish or not loads:
        raise ConfigError(
            f"{_where(runs)} has no publish or load spans: the run trained no step that a "
            "server loaded; profile a run of at least 20 steps"
        )
    fanout = []
    for run in runs:  # beyond the slowest server's load of the same version
        slowest: dict[int, float] = {}
        for e in _spans(run, "server", "load"):
            v = e.get("version")
            slowest[v] = max(slowest.get(v, 0.0), e["end"] - e["start"])
        fanout += [
            e["end"] - e["start"] - slowest[e["version"]]
            for e in _spans(run, "controller", "update_weights")
            if e.get("version") in slowest
        ]
    return Handoff(
        publish_s=float(np.median(publish)),
        load_s=float(np.median([e["end"] - e["start"] for e in loads])),
        fanout_s=max(0.0, float(np.median(fanout))) if fanout else 0.0,
    )


def fit_lengths(run: Run, group_size: int) -> Lengths:
    if not run.batches:
        raise ConfigError(f"{run.path} has no batches.jsonl: the output lengths come from it")
    groups = [
        b["output_len"][i : i + group_size]
        for b in run.batches
        for i in range(0, len(b["output_len"]), group_size)
    ]
    # Prompt tokens: an update's tokens less the outputs it trained on, per step.
    updates = [s for s in _spans(run, "trainer0", "update") if "tokens" in s]
    prompts = []
    for b in run.batches:
        tokens = sum(s["tokens"] for s in updates if s.get("version") == b["step"] - 1)
        if tokens:
            prompts.append((tokens - sum(b["output_len"])) / len(b["output_len"]))
    prompt_len = float(np.median(prompts)) if prompts else 16.0
    return Lengths(prompt_len=max(1.0, prompt_len), groups=groups)


def group_overhead(runs: list[Run], notes: list[str]) -> float:
    """Twice the time from a version's fan-out end (the gate opens) to an idle server's next
    generate span: admission to server, one way."""
    delays = []
    for run in runs:
        gens = _spans(run, "server", "generate")
        for u in _spans(run, "controller", "update_weights"):
            t = u["end"]
            if any(g["start"] <= t < g["end"] for g in gens):
                continue  # a server generating: nothing to measure
            later = [g["start"] - t for g in gens if 0 <= g["start"] - t < 0.5]
            if later:
                delays.append(min(later))
    if len(delays) < 3:
        notes.append(
            f"group overhead: no idle server to measure; {DEFAULT_GROUP_OVERHEAD_S} s assumed"
        )
        return DEFAULT_GROUP_OVERHEAD_S
    value = 2 * float(np.median(delays))
    notes.append(
        f"group overhead: {value * 1000:.1f} ms (twice admission -> server, {len(delays)} gaps)"
    )
    return value


def fit_controller(runs: list[Run], notes: list[str]) -> dict[str, float]:
    """The controller's CPU seconds per trajectory trained, by the runs' data planes: its CPU
    samples from the first published version on (start-up left out), over the trajectories
    of the steps published meanwhile."""
    totals: dict[str, list[float]] = {}  # plane -> [CPU seconds, trajectories]
    for run in runs:
        published = sorted(e["end"] for e in _spans(run, "trainer0", "publish"))
        if not published:
            continue
        samples = [e for e in run.cpu if e["role"] == "controller0" and e["start"] >= published[0]]
        if not samples:
            continue
        until = max(e["end"] for e in samples)
        steps = sum(1 for t in published[1:] if t <= until)
        per_step = int((run.config.get("trainer") or {}).get("batch_size", 0)) * _group_size(run)
        plane = str((run.config.get("rollout") or {}).get("data_plane", "pull"))
        cpu, n = totals.setdefault(plane, [0.0, 0.0])
        totals[plane] = [cpu + sum(e["cpu_s"] for e in samples), n + steps * per_step]
    costs = {plane: cpu / n for plane, (cpu, n) in totals.items() if n > 0}
    for plane, (cpu, n) in totals.items():
        if n > 0:
            notes.append(
                f"controller ({plane}): {1000 * costs[plane]:.3f} ms of CPU per trajectory "
                f"({cpu:.1f} s over {n:,.0f} trajectories)"
            )
    if not costs:
        notes.append("controller: no CPU samples after the first version; left out")
    return costs


def _group_size(run: Run) -> int:
    group_size = int((run.config.get("rollout") or {}).get("group_size", 0))
    if group_size < 1:
        raise ConfigError(f"{run.path}/config.yaml gives no rollout.group_size")
    return group_size


def _load(run_dir: str | Path) -> Run:
    try:
        run = load_run(run_dir)
    except NotARunError as e:
        raise ConfigError(f"cannot calibrate from {run_dir}: {e}") from None
    if not run.events:
        raise ConfigError(
            f"{run_dir} recorded no events (stats.events=false?): the planner's costs come from "
            "the timeline; profile a run with stats.events=true"
        )
    _group_size(run)
    return run


def calibrate(run_dirs: str | Path | list, cores: int | None = None) -> Profile:
    """The CPU profile of the run(s) at run_dirs (`cores`: the node's, by default this
    machine's). Several runs pool their spans into one fit; the output lengths are the first
    run's (the config as planned): profile the config as it is, and the same at
    max_staleness=0, whose roles take turns on lent cores (the speed-up of a lent core)."""
    dirs = list(run_dirs) if isinstance(run_dirs, list | tuple) else [run_dirs]
    runs = [_load(d) for d in dirs]
    notes: list[str] = [f"pooled from {len(runs)} runs"] if len(runs) > 1 else []
    cores = cores or node_cores()
    profile = Profile(
        device="cpu",
        cores=cores,
        decode=fit_decode(runs, notes),
        train=fit_train(runs, notes),
        handoff=fit_handoff(runs),
        lengths=fit_lengths(runs[0], _group_size(runs[0])),
        group_overhead_s=group_overhead(runs, notes),
        controller=fit_controller(runs, notes),
        source=" + ".join(str(Path(d).resolve()) for d in dirs),
        notes=notes + [f"cores: {cores} (the machine the profile was made on, unless given)"],
    )
    used = cores_used(runs[0])
    others = {r: c for r, c in used.items() if not r.startswith(("server", "trainer"))}
    if others:  # not simulated as roles: their share of the cores is in the fitted costs
        profile.notes.append(
            f"the other processes used {sum(others.values()):.2f} cores ("
            + ", ".join(f"{r} {c:.2f}" for r, c in others.items())
            + "), inside the fitted costs at this run's pace"
        )
    return profile
