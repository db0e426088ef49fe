"""The Ray launcher against the local one: the same run, the same plan, on this machine.

    python benchmarks/ray_vs_local.py [--steps 100] [--repeats 2] [--nodes 1] [key=value ...]

Starts a Ray cluster here (tests/ray/cluster.py: a head, and --nodes - 1 more nodes, 2 CPUs
each) and runs configs/tiny.yaml with launcher.type=local and with launcher.type=ray
(launcher.nodes=--nodes, CPU only), alternately. With --nodes 1 the plan is the local one
(every role on one node), so the difference is what placing on Ray costs; placement must
cost nothing per step. Effective throughput is the paper's (tiny_run.effective_throughput:
tokens trained per second of wall time after warm-up); medians over repeats, then the ratio.
"Ray cores" is what Ray's own processes (daemons, the roles' actors) used meanwhile, in cores.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

from tiny_run import effective_throughput, medians, train_tiny

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.ray.cluster import RayTestCluster, cmdline  # noqa: E402


def ray_cpu_s(cluster: RayTestCluster) -> float:
    """CPU seconds used so far by the cluster's own processes (Ray's daemons and the roles'
    actors; not the roles themselves), as far as they are alive."""
    ticks = 0
    for pid in cluster.processes():
        if "areal." in cmdline(pid):
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cluster is stopped below
    cluster = RayTestCluster(cpus=2, gpus=0).start(workers=args.nodes - 1)
    ray = [
        "launcher.type=ray",
        f"launcher.ray_address={cluster.address}",
        f"launcher.nodes={args.nodes}",
        "launcher.gpus_per_node=0",
    ]
    results: dict[str, list[dict]] = {"local": [], "ray": []}
    try:
        with tempfile.TemporaryDirectory() as root:
            for r in range(args.repeats):
                for name, extra in (("local", []), ("ray", ray)):
                    before = ray_cpu_s(cluster)
                    m = train_tiny(root, f"{name}{r}", args.steps, [*extra, *args.overrides])
                    results[name].append(
                        {
                            "tokens_per_s": effective_throughput(m),
                            "wall_s": m[-1]["time"],
                            # Ray's own processes, per second of the run: what placement costs.
                            "ray_cores": (ray_cpu_s(cluster) - before) / m[-1]["time"],
                        }
                    )
                    print(f"{name} #{r}: {results[name][-1]}", flush=True)
    finally:
        cluster.stop()
    med = medians(results)
    print(f"{'':8}{'tokens/s':>12}{'wall s':>10}{'Ray cores':>11}")
    for name, f in med.items():
        print(f"{name:8}{f['tokens_per_s']:12.1f}{f['wall_s']:10.1f}{f['ray_cores']:11.3f}")
    print(f"ray / local tokens/s: {med['ray']['tokens_per_s'] / med['local']['tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()
