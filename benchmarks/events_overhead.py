"""The cost of recording event spans: the tiny config with stats.events on and off.

    python benchmarks/events_overhead.py [--steps 60] [--repeats 2] [key=value ...]

Effective training throughput as in async_vs_sync.py (generated tokens consumed by PPO
updates per second, the first fifth of the steps left out as warm-up). Runs the two
variants interleaved, prints each run, the medians and on/off last (1.00x = no cost).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from tiny_run import effective_throughput, train_tiny


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both runs")
    args = parser.parse_args()
    variants = {"events on": ["stats.events=true"], "events off": ["stats.events=false"]}
    results: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.repeats):
            for name, extra in variants.items():  # interleaved: both see the same machine
                tag = name.replace(" ", "_") + str(r)
                m = train_tiny(root, tag, args.steps, [*extra, *args.overrides])
                results[name].append(effective_throughput(m))
                print(f"  repeat {r}: {name}: {results[name][-1]:.1f} train tok/s", flush=True)
    med = {v: statistics.median(x) for v, x in results.items()}
    for v, x in med.items():
        print(f"{v:<11} {x:>10.1f} train tok/s (median of {args.repeats})")
    ratio = med["events on"] / med["events off"]
    print(f"events on/off effective training throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
