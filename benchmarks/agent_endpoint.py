"""What an agent pays for the OpenAI-compatible endpoint: per call, and over a whole run.

    python benchmarks/agent_endpoint.py [--calls 50] [--max-tokens 8] [--steps 30] [--repeats 1]

1. Per call: one real embedded server (a subprocess) and the real rollout worker behind an
   RPC socket, as the controller reaches them. The same prompt, --calls times one after
   another: `engine.generate` (the single-turn workflow's path) against
   `client.chat.completions.create` through the endpoint (chat template, HTTP, JSON,
   decoding, the recorded call). Medians in ms and their difference: the endpoint's
   overhead per call.
2. Whole runs: configs/tiny.yaml with its single-turn workflow against the same episode
   written as an agent (examples/single_call.py: one call, graded by the agent) in an
   agent process. Effective training throughput (tokens trained per second of wall time
   after warm-up, as benchmarks/async_vs_sync.py) side by side, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tiny_run import effective_throughput, medians, train_tiny

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal.comm.rpc import RpcClient, RpcServer  # noqa: E402
from areal.controller.pool import WorkerPool  # noqa: E402
from areal.models.tiny import make_tiny_model  # noqa: E402
from areal.rollout.worker import RolloutWorker  # noqa: E402
from areal.workflow.api import RolloutEngine  # noqa: E402
from areal.workflow.openai_endpoint import OpenAIEndpoint  # noqa: E402
from tests.system.conftest import embedded_server  # noqa: E402

KEY = b"b" * 32
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


async def per_call(url: str, tokenizer, calls: int, max_tokens: int) -> dict[str, float]:
    import openai

    worker = RolloutWorker(url)
    server = RpcServer(KEY, host="127.0.0.1")
    for name in RolloutWorker.RPC_METHODS:
        server.register(name, getattr(worker, name))
    serving = asyncio.create_task(server.serve())
    rpc = RpcClient(server.address, KEY)
    pool = WorkerPool([rpc], Path(tempfile.mkdtemp()))
    sampling = {**SAMPLING, "max_new_tokens": max_tokens, "ignore_eos": True}
    engine = RolloutEngine(
        tokenizer=tokenizer, group_size=1, sampling_params=sampling, group_id=0,
        start_version=0, generate_fn=lambda ids, n, p: pool.generate(0, 0, ids, n, p),
    )  # fmt: skip
    endpoint = OpenAIEndpoint(
        tokenizer, model="tiny", default_max_tokens=max_tokens, sampling=sampling
    )
    await endpoint.start()
    session = endpoint.open_session(engine, max_turns=10**9)
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.token, max_retries=0)
    messages = [{"role": "user", "content": "3+4="}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    times: dict[str, list[float]] = {"engine.generate": [], "endpoint": []}
    try:
        for _ in range(calls):  # interleaved, so both see the same machine
            t = time.perf_counter()
            await engine.generate(ids, 1, max_tokens)
            times["engine.generate"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await client.chat.completions.create(model="tiny", messages=messages)
            times["endpoint"].append(time.perf_counter() - t)
    finally:
        await client.close()
        await endpoint.close()
        rpc.close()
        server.close()
        await asyncio.gather(serving, return_exceptions=True)
        await worker.client.close()
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="0 skips the whole runs")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", warmup_steps=0)
        tokenizer = AutoTokenizer.from_pretrained(model)
        with embedded_server(model, Path(tmp) / "server.log") as url:
            ms = asyncio.run(per_call(url, tokenizer, args.calls, args.max_tokens))
    print(f"per call, {args.max_tokens} new tokens, median of {args.calls}:")
    for name, value in ms.items():
        print(f"  {name:<16} {value:8.1f} ms")
    overhead = ms["endpoint"] - ms["engine.generate"]
    ratio = ms["endpoint"] / ms["engine.generate"]
    print(f"  endpoint overhead {overhead:7.1f} ms per call ({ratio:.2f}x)")
    if not args.steps:
        return
    variants = {
        "single-turn": [],
        "agent (process)": ["rollout.workflow=examples.single_call:run"],
    }
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.repeats):
            for v, overrides in variants.items():
                name = f"{v.split()[0]}{r}"
                m = train_tiny(root, name, args.steps, overrides)
                results[v].append(
                    {"tokens_per_s": effective_throughput(m), "wall_s": m[-1]["time"]}
                )
    med = medians(results)
    print(f"\nwhole tiny runs, {args.steps} steps, median of {args.repeats}:")
    print(f"  {'':<16} {'tokens/s':>9} {'wall s':>8}")
    for v, figures in med.items():
        print(f"  {v:<16} {figures['tokens_per_s']:9.0f} {figures['wall_s']:8.1f}")
    ratio = med["agent (process)"]["tokens_per_s"] / med["single-turn"]["tokens_per_s"]
    print(f"agent / single-turn effective throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
