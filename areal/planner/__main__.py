"""python -m areal.planner: the predicted grid of a config, and the choice it recommends.

    python -m areal.planner --config configs/tiny_longtail.yaml --profile RUN_DIR
    python -m areal.planner --config configs/math_1.5b.yaml --profile h200 --cluster 16x8

--profile: run directories, comma-separated (calibrated now, costs fitted from their
timelines: the config as it is, and best the same at max_staleness=0 too, for the speed-up of
lent cores), a profile JSON (--save-profile writes one), or h200 (docs/benchmarks/gpu.md).
On CPUs the grid is the number of servers (--servers) sharing --cores; with --cluster
NODESxGPUS it is launcher.inference_fraction (--fractions), split as areal/launcher/plan.py
splits GPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from areal.config import ConfigError, ExperimentConfig, load_config
from areal.planner.calibrate import WARNING, calibrate
from areal.planner.costs import BUILTIN, Profile, load_profile
from areal.planner.sim import Result, Setting, simulate

NEAR_BEST = 0.03
"""Grid points within this share of the best throughput tie; the smaller max_staleness wins
them (less staleness for the same speed), then the fewer servers."""


@dataclass
class Point:
    label: str
    """The grid's first axis: "servers=2" or "fraction=0.75 (96 servers, 32 training GPUs)"."""
    n_servers: int
    fraction: float | None
    max_staleness: int
    result: Result


def get_profile(spec: str, cores: int | None = None) -> Profile:
    """A built-in name, a profile JSON, or run directories (comma-separated) to calibrate
    from."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    dirs = spec.split(",")
    if all(Path(d).is_dir() for d in dirs):
        return calibrate(dirs, cores)
    return load_profile(spec)


def parse_cluster(text: str) -> tuple[int, int]:
    try:
        nodes, gpus = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--cluster {text!r}: write NODESxGPUS, e.g. 16x8") from None
    if nodes < 1 or gpus < 1:
        raise ConfigError(f"--cluster {text!r}: nodes and GPUs must be >= 1")
    return nodes, gpus


def gpu_split(cfg: ExperimentConfig, total: int, fraction: float) -> tuple[int, int]:
    """(servers, training GPUs): launcher/plan.py's rounding to whole servers."""
    tp = cfg.inference.tp_size
    n_inf = round(total * fraction) // tp * tp
    n_inf = min(max(n_inf, tp), (total - 1) // tp * tp)
    if n_inf < tp:
        raise ConfigError(f"{total} GPUs cannot hold a server of {tp} GPUs and a trainer")
    return n_inf // tp, total - n_inf


def plan_grid(
    cfg: ExperimentConfig,
    profile: Profile,
    max_staleness: list[int],
    servers: list[int] | None = None,
    fractions: list[float] | None = None,
    gpus: int = 0,
    steps: int | None = None,
    scale: int = 1,
) -> list[Point]:
    """Simulate every grid point: each of the `max_staleness` values, by `fractions` of `gpus`
    (GPUs) or `servers` counts (CPUs).
    scale > 1 divides servers, training GPUs, batch and groups in flight alike (each server
    and GPU sees the same load, in a run `scale` times smaller to simulate); 0 picks it.
    steps: simulated training steps (default: the config's, at most 40)."""
    steps = steps or min(cfg.total_train_steps, 40)
    points = []
    axis: list[tuple[str, int, float | None, int]] = []
    if gpus:
        for f in fractions or [cfg.launcher.inference_fraction]:
            n, train_gpus = gpu_split(cfg, gpus, f)
            label = f"fraction={f:g} ({n} servers, {train_gpus} training GPUs)"
            axis.append((label, n, f, train_gpus))
    else:
        for n in servers or [cfg.rollout.n_servers]:
            axis.append((f"servers={n}", n, None, 1))
    for label, n, f, train_gpus in axis:
        for bound in max_staleness:
            s = Setting.from_config(
                cfg, max_staleness=bound, n_servers=n, trainer_devices=train_gpus, steps=steps
            )
            k = _scale(s, scale)
            for name in SCALED:
                setattr(s, name, getattr(s, name) // k)
            result = simulate(profile, s)
            result.throughput *= k  # the whole run's: every part was k times smaller
            result.trajectories_per_s *= k
            limit_by_controller(result, profile.controller.get(cfg.rollout.data_plane))
            points.append(Point(label, n, f, bound, result))
    return points


def limit_by_controller(result: Result, traj_s: float | None) -> None:
    """The controller is one process: at traj_s CPU seconds a trajectory its core admits,
    gates and hands out at most 1 / traj_s trajectories a second, whatever the cluster. A plan
    that needs more runs at that rate, the controller its bottleneck (first order: the
    simulation leaves the controller out, and its work does not overlap itself)."""
    if traj_s is None:
        return
    need = result.trajectories_per_s
    result.controller_cores = need * traj_s
    if result.controller_cores > 1:
        result.throughput /= result.controller_cores
        result.trajectories_per_s = 1 / traj_s
        result.bottleneck = (
            f"the controller (its one core handles {1 / traj_s:,.0f} trajectories/s; the rest "
            f"of this plan would train {need:,.0f})"
        )


SCALED = ("n_servers", "trainer_devices", "batch_size", "max_concurrent")
"""What a smaller copy of a run divides alike: each server and training GPU keeps its load."""


def _scale(s: Setting, scale: int) -> int:
    """`scale`, checked; 0: the largest of 8, 4, 2 that divides them all (else 1)."""
    if s.max_concurrent == 0:
        s.max_concurrent = s.batch_size  # the gate's rule, explicit so that it scales
    if scale == 0:
        return next((k for k in (8, 4, 2) if all(getattr(s, n) % k == 0 for n in SCALED)), 1)
    for name in SCALED:
        if getattr(s, name) % scale:
            raise ConfigError(
                f"--scale {scale} does not divide {name}={getattr(s, name)}: pick a divisor "
                "(or --scale 0: the largest that divides them all)"
            )
    return scale


def recommend(points: list[Point]) -> Point:
    best = max(p.result.throughput for p in points)
    near = [p for p in points if p.result.throughput >= (1 - NEAR_BEST) * best]
    return min(near, key=lambda p: (p.max_staleness, p.n_servers))


def format_grid(points: list[Point]) -> str:
    lines = [
        f"{'':<46} {'max_staleness':>13} {'tok/s':>10} {'stale mean':>10} {'max':>4} "
        f"{'servers idle':>12} {'trainer idle':>12} {'controller':>10}  bottleneck"
    ]
    for p in points:
        r = p.result
        servers = [v for k, v in r.idle.items() if k.startswith("server")]
        lines.append(
            f"{p.label:<46} {p.max_staleness:>13} {r.throughput:>10,.0f} {r.staleness_mean:>10.2f} "
            f"{r.staleness_max:>4} {100 * sum(servers) / len(servers):>11.0f}% "
            f"{100 * r.idle['trainer0']:>11.0f}% {_core_share(r.controller_cores):>10}  "
            f"{r.bottleneck}"
        )
    best = recommend(points)
    lines.append(
        f"recommended: {best.label}, max_staleness={best.max_staleness} "
        f"({best.result.throughput:,.0f} tok/s predicted; bottleneck: {best.result.bottleneck})"
    )
    r = best.result
    if r.controller_cores is not None and r.controller_cores <= 1 and r.trajectories_per_s:
        limit = r.trajectories_per_s / r.controller_cores
        lines.append(
            f"controller: {100 * r.controller_cores:.0f}% of its one core for "
            f"{r.trajectories_per_s:,.0f} trajectories/s; it would set the pace from "
            f"{limit:,.0f} a second, {limit / r.trajectories_per_s:,.0f}x this plan's"
        )
    return "\n".join(lines)


def _core_share(cores: float | None) -> str:
    """The controller's column: the share of its core it needs ("-": not measured)."""
    return "-" if cores is None else f"{100 * cores:.0f}% core"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal.planner", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the run's YAML config")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, as areal.train's")
    ap.add_argument("--profile", help="run dir to calibrate from, profile JSON, or h200")
    ap.add_argument("--cluster", help="NODESxGPUS: plan GPUs (launcher.inference_fraction)")
    ap.add_argument("--cores", type=int, help="CPU cores the roles share (default: profile's)")
    ap.add_argument(
        "--max-staleness", default="0,1,2,4,8,16", help="max_staleness values to try (a list)"
    )
    ap.add_argument("--etas", help="deprecated: the old name of --max-staleness")
    ap.add_argument("--fractions", default="0.5,0.625,0.75,0.875", help="GPU inference shares")
    ap.add_argument("--servers", default="1,2", help="CPU: server counts to try")
    ap.add_argument("--steps", type=int, help="steps to simulate (default: config's, <= 40)")
    ap.add_argument(
        "--scale", type=int, default=0, help="simulate a run this many times smaller (0: auto)"
    )
    ap.add_argument("--save-profile", help="write the profile used (JSON) here")
    ap.add_argument("--json", action="store_true", help="print the grid as JSON")
    args = ap.parse_args(argv)
    if args.etas is not None:
        print("areal.planner: --etas is deprecated: use --max-staleness", file=sys.stderr)
        args.max_staleness = args.etas
    try:
        cfg = load_config(args.config, args.overrides)
        if not args.profile:
            raise ConfigError(
                "--profile is needed: a short profiling run's directory (python -m areal.train "
                f"--config {args.config} total_train_steps=30), a profile JSON, or h200"
            )
        profile = get_profile(args.profile, args.cores)
        if args.cores:
            profile.cores = args.cores
        gpus = 0
        if args.cluster:
            nodes, per_node = parse_cluster(args.cluster)
            gpus = nodes * per_node
            if profile.device != "gpu":
                raise ConfigError(
                    f"--cluster plans GPUs but the profile {args.profile} is a CPU one: give a "
                    "GPU profile (--profile h200) or plan CPUs with --cores"
                )
        elif profile.device == "gpu":
            raise ConfigError("a GPU profile needs --cluster NODESxGPUS (e.g. 16x8)")
        if args.save_profile:
            profile.save(args.save_profile)
        points = plan_grid(
            cfg,
            profile,
            _ints(args.max_staleness),
            servers=_ints(args.servers),
            fractions=_floats(args.fractions),
            gpus=gpus,
            steps=args.steps,
            scale=args.scale,
        )
    except ConfigError as e:
        print(f"areal.planner: {e}", file=sys.stderr)
        return 2
    if args.json:
        rows = [{**asdict(p.result), "label": p.label, "max_staleness": p.max_staleness}
                for p in points]  # fmt: skip
        print(json.dumps(rows))
        return 0
    print(f"profile: {profile.source}")
    print(format_fit(profile))
    print(format_grid(points))
    return 0


def format_fit(profile: Profile) -> str:
    """The profile's notes: how well each cost fitted, what was assumed, and warnings."""
    lines = [n for n in profile.notes if not n.startswith(WARNING)]
    warnings = [n for n in profile.notes if n.startswith(WARNING)]
    head = ["fit (what the plan below rests on):", *(f"  {n}" for n in lines)] if lines else []
    return "\n".join(head + [f"areal.planner: {w}" for w in warnings])


if __name__ == "__main__":
    sys.exit(main())
