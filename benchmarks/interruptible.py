"""Interruptible against non-interruptible generation, one server, the same workload.

    python benchmarks/interruptible.py [--seconds 20] [--update-every 1.0] [--repeats 3]
        [--model-dir DIR]   # e.g. the 1.5B shape on a GPU (benchmarks/shapes.py); default tiny

A real embedded server and the real rollout worker. A producer keeps --concurrency samples
in flight, with long-tailed lengths (lognormal, as reasoning outputs are: most short, a few
very long; the same seeded sequence for both variants); an updater loads new weights from
disk every --update-every seconds, as a trainer publishing versions would. Interruptible
(the paper): an update aborts what is in flight, loads, and the worker resumes it.
Non-interruptible (the ablation): the update waits for every in-flight sample to finish,
and admits nothing meanwhile, so the batch drains while the longest sample ends.

Generation throughput is the server's generated tokens per second of the window. Prints
both variants side by side (medians over --repeats, interleaved) and their ratio last.

    python benchmarks/interruptible.py --config configs/tiny_longtail.yaml [--steps 100]

The same comparison during whole training runs of a config (rollout.interruptible true
against false): generation throughput is the controller's generated tokens per second of
wall time (rollout/tokens_per_s weighted by each step's duration), after warm-up (the
first fifth of the steps), next to the effective training throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tiny_run import effective_throughput, medians, train_tiny

from areal.models.tiny import chat_prompt_ids, make_tiny_model
from areal.rollout.launch import start_embedded_server
from areal.rollout.worker import RolloutWorker


def sample_lengths(n: int, seed: int, median: int, cap: int) -> list[int]:
    rng = random.Random(seed)
    return [min(cap, max(1, round(median * rng.lognormvariate(0, 1.0)))) for _ in range(n)]


async def measure(url: str, interruptible: bool, args, versions: list[Path], seed: int) -> float:
    """Generated tokens per second over a window with periodic weight updates."""
    from transformers import AutoTokenizer

    prompt = chat_prompt_ids(AutoTokenizer.from_pretrained(versions[0]), "What is 2 plus 3?")
    lengths = iter(sample_lengths(100_000, seed, args.median_tokens, args.max_tokens))
    worker = RolloutWorker(url, interruptible=interruptible)
    # Versions go up across repeats: the server has already seen the earlier ones.
    version = int((await worker.client.server_info())["weight_version"])
    worker.version = version

    async def one_sample_at_a_time() -> None:
        while True:
            sampling = {"max_new_tokens": next(lengths), "ignore_eos": True, "temperature": 1.0}
            await worker.generate(0, prompt, 1, sampling, start_version=worker.version)

    stop = asyncio.Event()

    async def updater() -> None:
        nonlocal version
        while not stop.is_set():
            await asyncio.sleep(args.update_every)
            version += 1
            await worker.update_weights(version, str(versions[version % 2]))

    t0 = time.time()
    tokens0 = (await worker.client.server_info())["total_generated_tokens"]
    tasks = [asyncio.create_task(one_sample_at_a_time()) for _ in range(args.concurrency)]
    updates = asyncio.create_task(updater())
    await asyncio.sleep(args.seconds)
    tokens = (await worker.client.server_info())["total_generated_tokens"] - tokens0
    elapsed = time.time() - t0
    stop.set()
    await updates  # an update cut short could leave the server paused
    # Cancelled requests are aborted by the server (client disconnect): the next variant
    # starts on an idle server.
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await worker.client.close()
    while (await worker.client.server_info())["num_running_reqs"]:
        await asyncio.sleep(0.05)
    await worker.client.close()
    return tokens / elapsed


async def run(args, url: str, versions: list[Path]) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {"interruptible": [], "non-interruptible": []}
    for r in range(args.repeats):
        for name in results:  # interleaved: both see the same machine
            tok_s = await measure(url, name == "interruptible", args, versions, seed=r)
            results[name].append(tok_s)
            print(f"  repeat {r}: {name:<18} {tok_s:8.1f} tok/s", flush=True)
    return results


def generation_throughput(m: list[dict]) -> float:
    """Tokens generated per second of wall time after warm-up (each step's
    rollout/tokens_per_s covers the time since the step before)."""
    warm = len(m) // 5
    pairs = zip(m[warm:-1], m[warm + 1 :], strict=True)
    tokens = sum(x["rollout/tokens_per_s"] * (x["time"] - p["time"]) for p, x in pairs)
    return tokens / (m[-1]["time"] - m[warm]["time"])


def compare_runs(args) -> dict[str, float]:
    """Training runs of args.config, interleaved; {variant: median generation tok/s}."""
    results: dict[str, list[dict]] = {"interruptible": [], "non-interruptible": []}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.repeats):
            for name in results:
                flag = f"rollout.interruptible={name == 'interruptible'}".lower()
                m = train_tiny(root, f"{name}{r}", args.steps, [flag], args.config)
                results[name].append(
                    {
                        "generation": generation_throughput(m),
                        "training": effective_throughput(m),
                        "multi_version": sum(x["rollout/multi_version_samples"] for x in m),
                        "staleness": statistics.mean(x["staleness/mean"] for x in m),
                    }
                )
                print(f"  repeat {r}: {name:<18} {results[name][-1]}", flush=True)
    med = medians(results)
    print(
        f"{'variant':<18} {'generation tok/s':>17} {'train tok/s':>12} "
        f"{'multi-version samples':>22} {'staleness':>10}   (median of {args.repeats})"
    )
    for name, m in med.items():
        print(
            f"{name:<18} {m['generation']:>17.1f} {m['training']:>12.1f} "
            f"{m['multi_version']:>22.0f} {m['staleness']:>10.2f}"
        )
    return {name: m["generation"] for name, m in med.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--update-every", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--median-tokens", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument(
        "--model-dir", type=Path,
        help="serve this HF model (on the GPU if there is one) instead of the tiny one",
    )  # fmt: skip
    parser.add_argument("--config", type=Path, help="compare training runs of this config")
    parser.add_argument("--steps", type=int, default=100, help="with --config: steps a run")
    args = parser.parse_args()
    if args.config:
        med = compare_runs(args)
        ratio = med["interruptible"] / med["non-interruptible"]
        print(f"interruptible/non-interruptible generation throughput: {ratio:.2f}x")
        return
    with tempfile.TemporaryDirectory() as root:
        v0 = args.model_dir or make_tiny_model(Path(root) / "v0", warmup_steps=0)
        # The second version is the first's files again (links): a load costs the same.
        versions = [v0, Path(shutil.copytree(v0, Path(root) / "v1", copy_function=os.symlink))]
        dtype = json.loads((v0 / "config.json").read_text()).get("dtype", "float32")
        server, url = start_embedded_server(
            v0, Path(root) / "server.log", "--num-threads", str(args.num_threads),
            "--max-batch-size", str(args.concurrency), "--dtype", dtype,
        )  # fmt: skip
        try:

            async def go():
                from areal.rollout.client import SGLangClient

                client = SGLangClient(url)
                await client.wait_healthy(120, server)
                await client.close()
                return await run(args, url, versions)

            results = asyncio.run(go())
        finally:
            server.terminate()
            server.wait()
    med = {name: statistics.median(v) for name, v in results.items()}
    print(f"{'variant':<18} {'generation tok/s':>17}   (median of {args.repeats})")
    for name, value in med.items():
        print(f"{name:<18} {value:>17.1f}")
    ratio = med["interruptible"] / med["non-interruptible"]
    print(f"interruptible/non-interruptible generation throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
