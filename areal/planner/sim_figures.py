"""The simulation's figures: a run's throughput, staleness, idle shares and bottleneck,
from what its parts recorded (the trainer's steps, the roles' busy spans, the gate's shut
spans), counted as the benchmarks count a real run's."""

from __future__ import annotations

from dataclasses import dataclass

from areal.planner.sim_cores import _Role
from areal.planner.sim_servers import _Server


@dataclass
class Result:
    throughput: float
    """Effective training throughput: tokens trained per second after the first fifth."""
    staleness_mean: float
    staleness_max: int
    staleness_hist: dict[int, int]
    idle: dict[str, float]
    """Share of the measured window each role did not compute (servers: not decoding)."""
    held_by_max_staleness: float
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


def figures(
    records: list[dict],
    staleness: list[list[int]],
    servers: list[_Server],
    trainer: _Role,
    held: list[tuple[float, float]],
    capped: list[tuple[float, float]],
    now: float,
    max_staleness: int,
    warm: int | None = None,
    **counts: int,
) -> Result:
    """The Result of a run that ended `now`: records and staleness per step (the trainer's),
    the roles' busy spans, and the spans in which max_staleness (held) or the cap on groups
    in flight (capped) kept the gate shut; `counts`: the servers' generated, prefilled,
    interrupted. The first `warm` steps are left out (warm_steps)."""
    recs = records
    warm = warm_steps(len(recs), warm)
    t0, t1 = recs[warm]["time"], recs[-1]["time"]
    stale = [x for step in staleness[warm + 1 :] for x in step] or [0]
    hist: dict[int, int] = {}
    for x in stale:
        hist[x] = hist.get(x, 0) + 1

    def busy_share(role: _Role) -> float:
        return _overlap(_busy(role, now), t0, t1) / max(t1 - t0, 1e-12)

    idle = {f"server{s.index}": 1 - busy_share(s) for s in servers}
    idle["trainer0"] = 1 - busy_share(trainer)
    # Held by max_staleness: a server idle while the bound keeps the gate shut (mean over servers).
    capped_share = _overlap(capped, t0, t1) / max(t1 - t0, 1e-12)
    held_share = sum(
        _overlap(held, t0, t1) - _overlap_pairs(held, _busy(s, now), t0, t1) for s in servers
    ) / (len(servers) * max(t1 - t0, 1e-12))
    return Result(
        throughput=effective_throughput(recs, warm=warm),
        trajectories_per_s=effective_throughput(recs, "seqs", warm),
        staleness_mean=sum(stale) / len(stale),
        staleness_max=max(stale),
        staleness_hist=dict(sorted(hist.items())),
        idle=idle,
        held_by_max_staleness=held_share,
        step_times=[r["time"] for r in recs],
        bottleneck=bottleneck(idle, held_share, max_staleness, capped_share),
        **counts,
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


def warm_steps(steps: int, warm: int | None = None) -> int:
    """The steps a run's figures leave out: `warm`, or (None) the first fifth, the paper's
    warm-up."""
    return steps // 5 if warm is None else warm


def effective_throughput(
    records: list[dict], key: str = "train/n_tokens", warm: int | None = None
) -> float:
    """benchmarks/tiny_run.effective_throughput, here so the planner imports no benchmark:
    tokens (or another count of a step's) trained per second, the first warm_steps left out."""
    warm = warm_steps(len(records), warm)
    total = sum(x[key] for x in records[warm + 1 :])
    return total / max(records[-1]["time"] - records[warm]["time"], 1e-12)


def bottleneck(idle: dict[str, float], held: float, max_staleness: int, capped: float = 0.0) -> str:
    """Which role sets the pace, in words: the one that never waits."""
    trainer = idle["trainer0"]
    servers = [v for k, v in idle.items() if k.startswith("server")]
    server = sum(servers) / len(servers)
    if trainer < 0.1 and trainer <= server:
        return "trainer (it never waits; the servers are held by max_staleness or idle)"
    if server < 0.1:
        if capped > 0.5:
            return (
                "generation (the trainer waits; rollout.max_concurrent caps the groups in flight)"
            )
        return "generation (the servers never wait; the trainer waits for batches)"
    if max_staleness == 0:
        return "synchronous: the roles take turns (max_staleness=0)"
    if held > 0.5 * server:
        return "the staleness bound (servers held by max_staleness while the trainer waits too)"
    return "hand-off and overheads (both roles wait)"
