"""The Ray launcher against the local one: the same run, the same plan, on this machine.

    python benchmarks/ray_vs_local.py [--steps 100] [--repeats 2] [--nodes 1] [key=value ...]

Starts a Ray cluster here (tests/ray/cluster.py: a head, and --nodes - 1 more nodes, 2 CPUs
each) and runs configs/tiny.yaml with launcher.type=local and with launcher.type=ray
(launcher.nodes=--nodes, CPU only), alternately. With --nodes 1 the plan is the local one
(every role on one node), so the difference is what placing on Ray costs; placement must
cost nothing per step. Effective throughput is the paper's (tiny_run.effective_throughput:
tokens trained per second of wall time after warm-up); medians over repeats, then the ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tiny_run import effective_throughput, medians, train_tiny

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.ray.cluster import RayTestCluster  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
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
                    m = train_tiny(root, f"{name}{r}", args.steps, [*extra, *args.overrides])
                    results[name].append(
                        {"tokens_per_s": effective_throughput(m), "wall_s": m[-1]["time"]}
                    )
                    print(f"{name} #{r}: {results[name][-1]}", flush=True)
    finally:
        cluster.stop()
    med = medians(results)
    print(f"{'':8}{'tokens/s':>12}{'wall s':>10}")
    for name, figures in med.items():
        print(f"{name:8}{figures['tokens_per_s']:12.1f}{figures['wall_s']:10.1f}")
    print(f"ray / local tokens/s: {med['ray']['tokens_per_s'] / med['local']['tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()
