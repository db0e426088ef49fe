"""The data plane under load: relay (the old path) against pull (AReaL v0.5), in one run.

    python benchmarks/data_plane.py [--steps 10] [--batch 8] [--group 8] [--servers 2]
        [--ranks 2] [--mean-tokens 8000] [--tokens-per-s 100000] [--modes relay,pull]
        [--feed pipeline|replay] [--pin CPU] [--no-pull] [--max-staleness 4]
        [--out results.json]

Per mode, real processes on loopback: --servers fake inference servers speaking SGLang's
HTTP API (benchmarks/fake_sglang.py: long-tailed lengths, random tokens, no model), one
real rollout worker each (`areal.worker --role rollout`), the real reward service and
controller, and --ranks trainer ranks (a gloo world) that get each batch as the trainer
does (areal/trainer/worker.py: rank 0 asks the controller; relay: broadcast of the whole
batch; pull: broadcast of the references, each rank fetches its own share) and drop it
instead of training, then publish a version so the servers "load" it.

Reported per process, over the steps after the first two: CPU seconds (and per
trajectory), peak memory (VmHWM), resident memory at a tenth of the steps and at the end
(flat over a long run: `--steps 1600 --mean-tokens 64` is 102,400 trajectories), and bytes
moved; for the run: trajectories/s, the
controller's bytes per step against the batch's bytes, p50/p99 of admit-to-buffer, and the
controller's implied limit on one core (1 / its CPU seconds per trajectory). On this
2-core machine every process shares the cores, so trajectories/s is what the whole
pipeline sustains here; the controller's CPU seconds per trajectory is its own cost.

--feed replay measures the controller's sustained rate instead of inferring it: in place of
the servers and rollout workers, --servers feeders (benchmarks/replay_feeder.py) answer the
real controller's generate calls at once, over the real RPC layer, with references to
trajectories they hold in the real TrajectoryStore (long-tailed lengths cut at
--max-tokens: --mean-tokens 9200 gives a mean of ~8,190; tokens sliced from pre-built
buffers; no decode, random 0/1 rewards), and serve the trainer ranks' fetches, whose bytes
really travel. The trainer ranks consume as above, so the gate admits on trained versions;
--no-pull: they take the references and fetch nothing (the controller's own limit, when the
ranks' pulls cannot keep up on this machine). --pin C puts the controller alone on CPU C
and every other process on the other CPUs. Checked per run and printed: the staleness of
every trained sample (oldest token, and the gate's start version) <= --max-staleness (the
config's max_staleness), every trajectory and draw trained once, and (replay) the bytes the
ranks pulled == the bytes the feeders served; trajectories/s is also given for the slowest
tenth of the steps. The JSON's max_staleness is the bound, staleness_max the largest seen.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------- a trainer rank that drops


def trainer_rank(
    exp_dir: Path, rank: int, world: int, steps: int, out: Path, pull: bool = True
) -> None:
    """One rank: get each batch as the trainer does, drop it, publish the next version.
    pull False (--no-pull): take the references and fetch nothing (the controller alone)."""
    from areal.comm.registry import Registry, load_key
    from areal.comm.rpc import SyncRpcClient
    from areal.config import load_config
    from areal.data_plane import Puller
    from areal.trainer.parallel import init_data_parallel
    from areal.trainer.worker import batch_trajectories, staleness
    from areal.trajectory import TrajectoryRef
    from areal.worker import step_plan

    cfg = load_config(str(exp_dir / "config.yaml"))
    key = load_key(exp_dir)
    dp = init_data_parallel(world, rank, timeout_s=600)
    controller = None
    if dp.is_main:
        address = Registry(exp_dir).lookup("controller", 0, timeout=300)
        controller = SyncRpcClient(address, key)
    puller = Puller(key, exp_dir / "logs")
    # Written as it goes (the ids of 100,000 trajectories stay out of this rank's memory),
    # renamed to `out` at the end: the harness's sign that the rank is done.
    lines = open(out.with_suffix(".tmp"), "w", buffering=1)
    for version in range(steps):
        t0 = time.time()
        before = controller.bytes_in if controller else 0
        reply = controller.call("get_batch", version=version) if dp.is_main else None
        reply_bytes = (controller.bytes_in - before) if controller else 0
        reply = dp.broadcast_object(reply)
        received = dp.broadcast_object(reply_bytes)  # relay: what every rank receives
        pulled_before = puller.bytes_in
        if pull:
            trajs, _ = batch_trajectories(step_plan(cfg), reply, version, dp, puller)
        else:
            trajs = [TrajectoryRef.from_wire(d) for d in reply["trajectories"]]
        if puller.bytes_in > pulled_before:
            received = (reply_bytes if dp.is_main else 0) + puller.bytes_in - pulled_before
        tokens = sum(t.n_prompt + t.n_output for t in trajs)
        # The bound, as the trainer reports it (oldest token) and as the gate admits (start).
        stale = max(staleness(trajs, version) + [version - t.start_version for t in trajs])
        if dp.is_main:
            controller.call("weights_ready", version=version + 1, path=str(exp_dir / "weights"))
            (exp_dir / "progress").write_text(str(version + 1))
        stats = reply["stats"]
        line = (
            {
                "step": version, "t0": t0, "t1": time.time(), "n": len(trajs),
                "tokens": tokens, "received": received,
                "pulled": puller.bytes_in - pulled_before,
                "controller_bytes": stats.get("data/controller_bytes", 0),
                "p50": stats.get("rollout/admit_to_buffer_p50_s"),
                "p99": stats.get("rollout/admit_to_buffer_p99_s"),
                "stale": stale, "draw_ids": stats.get("batch/draw_ids", []),
                "traj_ids": [d.get("traj_id") for d in reply["trajectories"]]
                if dp.is_main
                else [],
            }
        )  # fmt: skip
        lines.write(json.dumps(line) + "\n")
    lines.close()
    out.with_suffix(".tmp").rename(out)
    deadline = time.time() + 120  # alive until the harness has read its CPU and memory
    while not (exp_dir / "exit").exists() and time.time() < deadline:
        time.sleep(0.05)
    dp.barrier()
    puller.close()
    dp.close()


# ---------------------------------------------------------------- the harness


def proc_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds, peak resident KiB) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return cpu, vm_kib(pid, "VmHWM")


def vm_kib(pid: int, key: str) -> int:
    """A process's /proc status figure in KiB: VmHWM (peak resident), VmRSS (resident now)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def run_mode(mode: str, args: argparse.Namespace, root: Path) -> dict:
    label = "replay" if args.feed == "replay" else mode
    from areal.comm.net import free_port
    from areal.comm.registry import Registry, load_key
    from areal.comm.rpc import SyncRpcClient
    from areal.config import load_config
    from areal.train import prepare_experiment

    overrides = [
        f"fileroot={root}", f"trial_name={label}", f"rollout.data_plane={mode}",
        f"rollout.n_servers={args.servers}", f"rollout.group_size={args.group}",
        f"trainer.batch_size={args.batch}", f"rollout.max_new_tokens={args.max_tokens}",
        f"max_staleness={args.max_staleness}", "rollout.max_concurrent=0",
        "ppo.dynamic_sampling=false", f"trainer.parallel.dp={args.ranks}",
        "model.tiny_warmup_steps=0", "stats.events=false",
    ]  # fmt: skip
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), overrides)
    shutil.rmtree(cfg.exp_dir, ignore_errors=True)
    prepare_experiment(cfg)
    exp = cfg.exp_dir
    (exp / "weights").mkdir(exist_ok=True)  # what the trainer ranks "publish" every step
    from areal.tokenizer import load_tokenizer

    vocab = len(load_tokenizer(cfg.model.path))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, cmd: list[str], extra: dict | None = None) -> None:
        log = open(exp / "logs" / f"{name}.log", "w")
        procs[name] = subprocess.Popen(
            cmd, env={**env, **(extra or {})}, stdout=log, stderr=subprocess.STDOUT
        )

    # --pin C: the controller alone on CPU C, every other process on the other CPUs.
    cpus = sorted(os.sched_getaffinity(0))
    others = None if args.pin is None else ",".join(str(c) for c in cpus if c != args.pin)

    def pin(cpu: int | str | None) -> list[str]:
        return [] if cpu is None else ["taskset", "-c", str(cpu)]

    registry = Registry(exp)
    try:
        role = [sys.executable, "-m", "areal.worker", "--exp-dir", str(exp), "--role"]
        if args.feed == "replay":  # feeders in place of the servers and rollout workers
            for k in range(args.servers):
                start(f"feeder{k}", [*pin(others), sys.executable,
                      str(ROOT / "benchmarks/replay_feeder.py"), "--exp-dir", str(exp),
                      "--index", str(k), "--mean-tokens", str(args.mean_tokens),
                      "--seed", str(k)])  # fmt: skip
        else:
            for k in range(args.servers):
                port = free_port()
                start(f"server{k}", [*pin(others), sys.executable,
                      str(ROOT / "benchmarks/fake_sglang.py"),
                      "--port", str(port), "--mean-tokens", str(args.mean_tokens),
                      "--tokens-per-s", str(args.tokens_per_s), "--vocab", str(vocab),
                      "--seed", str(k)])  # fmt: skip
                registry.register("server", k, f"http://127.0.0.1:{port}")
        start("reward0", [*pin(others), *role, "reward"])
        if args.feed != "replay":
            for k in range(args.servers):
                start(f"rollout{k}", [*pin(others), *role, "rollout", "--index", str(k)])
        start("controller0", [*pin(args.pin), *role, "controller"])
        master = str(free_port())
        for r in range(args.ranks):
            dist = {"RANK": str(r), "WORLD_SIZE": str(args.ranks), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": master, "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
            start(f"trainer{r}", [*pin(others), sys.executable, __file__,
                  "--trainer-rank", str(r), "--exp-dir", str(exp), "--steps", str(args.steps),
                  "--ranks", str(args.ranks), *(["--no-pull"] if args.no_pull else [])],
                  dist)  # fmt: skip
        # CPU at the start of the measured window: after the first two steps.
        t_end = time.time() + args.timeout
        marks: dict[str, float] = {}
        steps_file = exp / "steps.rank0.jsonl"
        progress = ""
        rss: dict[str, list[int]] = {}  # resident KiB of each process after each step
        while progress != str(args.steps) or not all(
            (exp / f"steps.rank{r}.jsonl").exists() for r in range(args.ranks)
        ):
            if time.time() > t_end:
                raise TimeoutError(f"{mode}: no end within {args.timeout} s; see {exp}/logs")
            dead = [n for n, p in procs.items() if p.poll() not in (None, 0)]
            if dead:
                raise RuntimeError(f"{mode}: {dead} died; see {exp}/logs")
            before, progress = (
                progress,
                ((exp / "progress").read_text() if (exp / "progress").exists() else ""),
            )
            if progress.strip() and progress != before:
                for n, p in procs.items():
                    rss.setdefault(n, []).append(vm_kib(p.pid, "VmRSS"))
            if not marks and progress.strip() == "2":
                marks = {n: proc_stat(p.pid)[0] for n, p in procs.items()}
                marks["t"] = time.time()
            time.sleep(0.05)
        final = {n: proc_stat(p.pid) for n, p in procs.items() if p.poll() is None}
        served = []  # what each feeder made and served its trainer ranks
        if args.feed == "replay":
            for k in range(args.servers):
                feeder = SyncRpcClient(registry.lookup("rollout", k), load_key(exp))
                served.append(feeder.call("served", timeout=30))
                feeder.close()
        (exp / "exit").write_text("")
        for r in range(args.ranks):
            procs[f"trainer{r}"].wait(60)
        lines = [json.loads(x) for x in steps_file.read_text().splitlines()]
        ranks = [
            [json.loads(x) for x in (exp / f"steps.rank{r}.jsonl").read_text().splitlines()]
            for r in range(args.ranks)
        ]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    measured = lines[2:]
    n = sum(x["n"] for x in measured)
    seconds = measured[-1]["t1"] - lines[1]["t1"]
    batch_bytes = [sum(r[i]["received"] for r in ranks) for i in range(2, len(lines))]
    if mode == "relay":  # every rank received the whole batch: the batch is one copy
        batch_bytes = [ranks[0][i]["received"] for i in range(2, len(lines))]
    per_proc = {}
    window = measured[-1]["t1"] - marks["t"] if marks else seconds  # the CPU marks' window
    for name, (cpu, peak) in final.items():
        used = cpu - marks.get(name, 0.0) if marks else cpu
        # Memory over the run: resident at a tenth of the steps (warm) and at the end.
        series = rss.get(name) or [0]
        first, last = series[len(series) // 10], series[-1]
        since_tenth = n * (1 - (len(series) // 10) / len(series))  # trajectories
        per_proc[name] = {
            "cpu_s": used,
            "cpu_ms_per_traj": 1000 * used / n,
            "cpu_busy": used / max(window, 1e-9),  # share of one core over the window
            "peak_mib": peak / 1024,
            "rss_tenth_mib": first / 1024,
            "rss_end_mib": last / 1024,
            "rss_growth_kib_per_10k": (last - first) / max(since_tenth, 1) * 1e4,
            "rss_mib_by_tenth": [series[len(series) * k // 10] / 1024 for k in range(10)]
            + [last / 1024],
        }
    for r in range(args.ranks):
        per_proc.setdefault(f"trainer{r}", {})["bytes_per_step"] = statistics.median(
            x["received"] for x in ranks[r][2:]
        )
    ctrl = per_proc.get("controller0", {})
    # Sustained: trajectories/s in each tenth of the measured steps (the slowest tenth).
    rates = []
    for k in range(10):
        lo, hi = 2 + (len(lines) - 2) * k // 10, 2 + (len(lines) - 2) * (k + 1) // 10
        if hi > lo:
            dt = lines[hi - 1]["t1"] - lines[lo - 1]["t1"]
            rates.append(sum(x["n"] for x in lines[lo:hi]) / max(dt, 1e-9))
    traj_ids = [i for x in lines for i in x["traj_ids"]]
    draw_ids = [i for x in lines for i in x["draw_ids"]]
    pulled = sum(x["pulled"] for r in ranks for x in r)
    return {
        "mode": label,
        "steps": len(lines),
        "max_staleness": args.max_staleness,
        "pin": args.pin,
        "pull": not args.no_pull,
        "traj_per_s_slowest_tenth": min(rates),
        "traj_per_s_tenths": rates,
        "staleness_max": max(x["stale"] for x in lines),
        "steps_at_the_bound": sum(x["stale"] == args.max_staleness for x in lines),
        "trained_trajectories": len(traj_ids),
        "trained_once": len(set(traj_ids)) == len(traj_ids) and len(set(draw_ids)) == len(draw_ids),
        "pulled_bytes": pulled,
        "pulled_bytes_per_s": sum(x["pulled"] for r in ranks for x in r[2:]) / seconds,
        "served": served,
        "served_bytes": sum(f["fetch_bytes"] for f in served) if served else None,
        "trajectories": n,
        "traj_per_s": n / seconds,
        "mean_tokens": sum(x["tokens"] for x in measured) / n,
        "controller_bytes_per_step": statistics.median(x["controller_bytes"] for x in measured),
        "batch_bytes_per_step": statistics.median(batch_bytes),
        "admit_p50_s": statistics.median(x["p50"] for x in measured if x["p50"] is not None),
        "admit_p99_s": max(x["p99"] for x in measured if x["p99"] is not None),
        "controller_limit_traj_per_s": 1000 / ctrl["cpu_ms_per_traj"] if ctrl else float("nan"),
        "controller_busy": ctrl.get("cpu_busy", float("nan")),
        "procs": per_proc,
    }


def report(results: list[dict]) -> None:
    modes = [r["mode"] for r in results]
    rows = [
        ("trajectories measured", "trajectories", "{:.0f}"),
        ("mean tokens / trajectory", "mean_tokens", "{:.0f}"),
        ("pipeline trajectories/s (this machine)", "traj_per_s", "{:.1f}"),
        ("  in the slowest tenth of the steps", "traj_per_s_slowest_tenth", "{:.1f}"),
        ("controller bytes / step", "controller_bytes_per_step", "{:.3g}"),
        ("batch bytes / step", "batch_bytes_per_step", "{:.3g}"),
        ("admit-to-buffer p50 s", "admit_p50_s", "{:.3f}"),
        ("admit-to-buffer p99 s (max over steps)", "admit_p99_s", "{:.3f}"),
        ("controller limit, traj/s on one core", "controller_limit_traj_per_s", "{:.0f}"),
        ("controller CPU busy (share of one core)", "controller_busy", "{:.2f}"),
        ("pulled bytes/s (all ranks)", "pulled_bytes_per_s", "{:.3g}"),
        ("largest staleness over the steps", "staleness_max", "{:.0f}"),
        ("steps whose batch is at the bound", "steps_at_the_bound", "{:.0f}"),
    ]
    head = f"{'':42}" + "".join(f"{m:>14}" for m in modes)
    print(head + (f"{'ratio':>10}" if len(modes) == 2 else ""))
    for label, key, fmt in rows:
        vals = [r[key] for r in results]
        line = f"{label:42}" + "".join(f"{fmt.format(v):>14}" for v in vals)
        if len(vals) == 2 and vals[0]:
            line += f"{vals[1] / vals[0]:>10.3g}"
        print(line)
    for r in results:
        bound, pin = r["max_staleness"], r["pin"]
        where = (
            "every process on every CPU"
            if pin is None
            else (f"controller0 pinned to CPU {pin}, every other process to the other CPUs")
        )
        print(
            f"{r['mode']}: {r['steps']} steps, max_staleness={bound}; {where}; trainer ranks "
            + ("pull their shards" if r["pull"] else "take the references and pull nothing")
        )
        ok = r["staleness_max"] <= bound and r["trained_once"]
        print(
            f"{r['mode']}: bound {'holds' if ok else 'BROKEN'}: largest staleness "
            f"{r['staleness_max']} <= max_staleness {bound}; {r['trained_trajectories']} "
            f"trajectories trained, {'each once' if r['trained_once'] else 'SOME TWICE'}"
        )
        if r["served"]:
            same = "==" if r["served_bytes"] == r["pulled_bytes"] else "!="
            print(
                f"{r['mode']}: bytes pulled by the ranks {r['pulled_bytes']} {same} served "
                f"by the feeders {r['served_bytes']}; made "
                f"{sum(f['made'] for f in r['served'])} trajectories, fetched "
                f"{sum(f['fetched'] for f in r['served'])}"
            )
        share = r["controller_bytes_per_step"] / max(r["batch_bytes_per_step"], 1)
        if r["pull"]:  # else the batch's bytes never move
            print(
                f"{r['mode']}: controller bytes per step = {100 * share:.2f}% of the batch's bytes"
            )
    print("\nresident memory, MiB at a tenth of the steps -> at the end (KiB per 10k trajectories)")
    for name in sorted({n for r in results for n in r["procs"]}):
        cells = [
            f"{r['mode']}: {p['rss_tenth_mib']:6.0f} -> {p['rss_end_mib']:6.0f} "
            f"({p['rss_growth_kib_per_10k']:+.0f})"
            for r in results
            if "rss_end_mib" in (p := r["procs"].get(name, {}))
        ]
        print(f"{name:14}" + " | ".join(cells))
    print("\nper process (measured window): CPU ms per trajectory | peak MiB | bytes in / step")
    names = sorted({n for r in results for n in r["procs"]})
    for name in names:
        cells = []
        for r in results:
            p = r["procs"].get(name, {})
            b = p.get("bytes_per_step")
            cells.append(
                f"{p.get('cpu_ms_per_traj', float('nan')):7.3f} {p.get('peak_mib', 0):7.0f}"
                + (f" {b:10.3g}" if b is not None else " " * 11)
            )
        pairs = zip(results, cells, strict=True)
        print(f"{name:14}" + " | ".join(f"{r['mode']}: {c}" for r, c in pairs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="answers per prompt")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--mean-tokens", type=float, default=8000)
    p.add_argument("--max-tokens", type=int, default=27648)
    p.add_argument("--tokens-per-s", type=float, default=100000, help="per request")
    p.add_argument("--modes", default=None, help="relay,pull (replay: pull only)")
    p.add_argument(
        "--feed",
        choices=("pipeline", "replay"),
        default="pipeline",
        help="pipeline: fake servers, rollout workers, grading; replay: feeders "
        "(benchmarks/replay_feeder.py) answer the controller at once, from pre-built tokens",
    )
    p.add_argument("--max-staleness", type=int, default=4, help="the config's max_staleness")
    p.add_argument("--pin", type=int, default=None, help="CPU for the controller alone")
    p.add_argument("--no-pull", action="store_true", help="trainer ranks fetch nothing")
    p.add_argument("--out", default=None, help="write the results (JSON) here too")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--root", default="/tmp/areal-data-plane-bench")
    p.add_argument("--trainer-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--exp-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer_rank is not None:
        exp = Path(args.exp_dir)
        out = exp / f"steps.rank{args.trainer_rank}.jsonl"
        trainer_rank(exp, args.trainer_rank, args.ranks, args.steps, out, not args.no_pull)
        return
    if args.modes is None:
        args.modes = "pull" if args.feed == "replay" else "relay,pull"
    if args.feed == "replay" and args.modes != "pull":
        p.error("--feed replay feeds the pull data plane only (--modes pull)")
    results = [run_mode(m, args, Path(args.root)) for m in args.modes.split(",")]
    print(json.dumps(results, indent=1), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    report(results)


if __name__ == "__main__":
    main()
